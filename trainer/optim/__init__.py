"""The optimizer (`optimizer.py`), the learning-rate schedule (`lr_schedule.py`) and the
batch-size ramp (`batch_schedule.py`)."""
