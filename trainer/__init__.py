"""A TOML-configured, PyTorch-native pretraining trainer (FSDP2/HSDP, bf16, DCP)."""
