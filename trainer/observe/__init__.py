"""What a run reports: loss, throughput, MFU and memory to stdout and TensorBoard
(`metrics.py`), Weights & Biases (`wandb_logger.py`) and the torch profiler (`profiling.py`)."""
