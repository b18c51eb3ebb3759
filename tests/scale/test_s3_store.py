"""The store on an S3 server (moto on loopback, through s3fs) as several hosts use it: each host's process sees what
the others commit. (tests/test_store.py runs the store's cases on the same server, one process.)"""

from __future__ import annotations

import subprocess
import sys
import uuid

import numpy as np

from loraflow.store import Store
from tests.factory import REPO
from tests.servers import make_bucket

COMMIT = """import sys, numpy as np
from loraflow.store import Store
store = Store(sys.argv[1])
store.put("latents", [{"key": "theirs", "latent": np.ones(3, np.float32)}])
store.write_manifest("latents", [{"key": "theirs"}], part="their-dataset")
"""


def test_a_long_lived_store_sees_shards_and_manifests_other_processes_commit(s3_env) -> None:
    url = make_bucket(s3_env, f"hosts-{uuid.uuid4().hex[:12]}") + "/cache"
    store = Store(url)
    store.put("latents", [{"key": "mine", "latent": np.zeros(3, np.float32)}])
    assert store.keys("latents") == {"mine"} and store.manifest_parts("latents") == []
    subprocess.run([sys.executable, "-c", COMMIT, url], cwd=REPO, check=True, timeout=60)  # another host's worker

    assert store.keys("latents") == {"mine", "theirs"}  # a listing cached from before would miss "theirs"
    assert store.manifest_parts("latents") == ["their-dataset"]
    assert store.read_manifest("latents") == [{"key": "theirs"}]
