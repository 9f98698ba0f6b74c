"""What a run will need before it launches: device and host memory, communication volume and
throughput, computed from the config and the model's shapes on the meta device.

- `memory.py`: the per-device memory plan and the largest local batch that fits;
- `activations.py`: saved activations per block under each AC policy;
- `host.py`: host RAM (data, checkpoint staging, CPU offload);
- `comm.py`: bytes each collective moves per step;
- `report.py`: the command line on top of them, `python -m trainer.plan` (`__main__.py`).
"""
