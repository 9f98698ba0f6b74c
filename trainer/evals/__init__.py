"""Downstream evals in the training loop: multiple-choice tasks scored by log-likelihood as
lm-evaluation-harness scores them. config.py (the [eval] section), tasks.py (built-in, JSONL
and Hugging Face tasks), stdlib_next_line.py (the built-in task), scoring.py (tokenization and
log-likelihoods), evaluator.py (sharded over the dp ranks, world-size independent).

Light on purpose: trainer.config.job imports the config module without torch.
"""
