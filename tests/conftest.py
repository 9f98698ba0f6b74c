import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _offline_caches(tmp_path_factory):
    """No downloads and no writes to the user's caches: HF and the data cache live in tmp."""
    root = tmp_path_factory.mktemp("caches")
    os.environ["HF_HOME"] = str(root / "hf")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
