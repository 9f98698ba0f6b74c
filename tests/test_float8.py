"""`[float8]` refuses, in one `config error:` line before any process starts, where it cannot
run: on the CPU and without torchao. (Training in float8 needs a GPU with sm >= 89.)"""

import importlib.util

import pytest
import torch

from trainer.config.__main__ import main
from trainer.config.job import load_config
from trainer.errors import ConfigError
from trainer.parallel.float8 import check_device


def check(capsys, *argv):
    code = main(["--check", "--world-size", "1", *argv])
    return code, capsys.readouterr().err


def test_cpu_is_refused(capsys):
    code, err = check(capsys, "--float8.enable", "true", "--training.device", "cpu")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(
        "config error: float8.enable = true needs a CUDA GPU with compute capability >= 8.9"
    )


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao installed")
def test_missing_torchao_is_refused(capsys):
    code, err = check(capsys, "--float8.enable", "true", "--training.device", "auto")
    assert code == 2 and err.count("\n") == 1
    assert (
        err.startswith("config error: float8.enable = true needs torchao")
        and 'pip install -e ".[float8]"' in err
    )


def test_off_by_default_and_device_check():
    cfg = load_config([])
    assert cfg.float8.enable is False
    check_device(cfg.float8, torch.device("cpu"))  # off: nothing to refuse
    cfg.float8.enable = True
    with pytest.raises(ConfigError, match="this run is on cpu"):
        check_device(cfg.float8, torch.device("cpu"))
