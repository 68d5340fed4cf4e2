"""Imported by the fork server only, right after its lifeline (launch.py): importing ``torch._dynamo``
makes inductor's cache directory at once (``torch._inductor.runtime.cache_dir_utils.cache_dir``; by
default ``$TMPDIR/torchinductor_<user>``, which every run left behind, and whose path every forked
process inherited). The preloads get a scratch directory of the fork server's own instead, which
``_forkserver_heap`` (the last preload) removes with its name: every process the fork server forks
names its caches and temporary directory in the run directory (``launch.torch_cache_env``). Nothing
else imports this module."""

import os
import tempfile

SCRATCH_ENV = "FSDPBENCH_FORKSERVER_SCRATCH"

os.environ[SCRATCH_ENV] = tempfile.mkdtemp(prefix="fsdpbench-forkserver-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[SCRATCH_ENV]
