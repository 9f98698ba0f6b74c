"""The learning-rate schedule: the lr factor of every step, torch-free (trainer.config.job checks
with it before any launch; trainer/optim/optimizer.py applies it).

The lr of step s (1-based, the step the TensorBoard tag `lr` is logged at) of a run of
T = training.steps steps is `optimizer.lr * factor(s)` (Muon's matrices: muon_lr * factor(s),
tag `lr_muon`), with W = lr_scheduler.warmup_steps,
f = lr_scheduler.min_lr_factor and K the number of decay steps:

    K = decay_steps                    if lr_scheduler.decay_steps >= 0
      = round(decay_ratio * T)         if lr_scheduler.decay_ratio >= 0  (round half to even)
      = max(0, T - W - 1)              otherwise (the default: decay over every step after W + 1)

    factor(s) = s / (W + 1)                                 s <= W           warmup
              = 1                                           W < s <= T - K   stable
                                                                             (every s > W if K = 0)
              = f + (1 - f) * shape(min(1, (s - T + K) / K))  s > T - K        decay

    shape(p) = 1 - p (linear) | (1 + cos(pi * p)) / 2 (cosine) | 1 - sqrt(p) (sqrt)

So the decay covers steps T - K + 1 .. T, and when K > 0 the last step T trains at exactly
f * lr (with K = 0 no step decays). The
config requires W + K <= T when decay_steps or decay_ratio is set.

Changing the schedule at a resume: a checkpoint restores only the schedule's position (the
step). The formula, optimizer.lr and muon_lr are the resumed run's config, and the first step
after a resume from step N trains at `optimizer.lr * factor(N + 1)` of that config (the checkpoint's
next lr is printed next to it when the two differ). Hence:

- With an explicit decay_steps, factor(s) depends only on (s, W, K, T) and the stable phase
  is exactly the peak: raising training.steps at a resume from a stable-phase step N <= T - K
  changes no lr of steps 1..N and causes no jump; the decay moves to the new end. decay_ratio
  keeps that property too (T - round(decay_ratio * T) never decreases with T), but its decay
  grows with T.
- With the default, T sets the decay slope: a resume with another training.steps changes the
  lr of every later step, and the lr jumps at the resume.
- Two stages (warmup-stable-decay): train with decay_steps = K (or 0: no decay) and a large
  training.steps; to decay from a stable-phase checkpoint at step N, resume it with
  `--training.steps N+K --lr_scheduler.decay_steps K`: steps N+1 .. N+K decay.
"""

from __future__ import annotations

import math

DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}


def decay_steps(cfg, total_steps: int) -> int:
    """K, the number of final steps over which the lr decays (`cfg` is `[lr_scheduler]`)."""
    if cfg.decay_steps >= 0:
        return cfg.decay_steps
    if cfg.decay_ratio >= 0:
        return round(cfg.decay_ratio * total_steps)
    return max(0, total_steps - cfg.warmup_steps - 1)


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    total_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr for the 1-based `step` (the module docstring's factor(s))."""
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    decay_start = total_steps - decay_steps  # the last step at the peak
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    return min_lr_factor + (1.0 - min_lr_factor) * DECAY_SHAPES[decay_type](progress)
