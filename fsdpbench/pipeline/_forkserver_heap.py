"""Imported by the fork server only, last of its preloads (launch.py): moves every object the preloads
created (torch's modules, pandas', fsdpbench's: hundreds of thousands) out of the cyclic garbage
collector's sight, for the fork server and every process it forks. A rank's or the traced predictor's
allocation-heavy Python (parsing the profiled step's Chrome trace, its intervals) otherwise set off
collections that walked that whole heap again and again: a rank's trace analysis took 0.4-0.7 s, of
which 0.05 s was the analysis. Objects created later are collected as usual. Also removes the scratch
cache directory the preloads were given (``_forkserver_scratch``), and its name from the environment
the forked processes inherit. Nothing else imports this module."""

import gc
import os
import shutil

from fsdpbench.pipeline._forkserver_scratch import SCRATCH_ENV

gc.freeze()
shutil.rmtree(os.environ.pop(SCRATCH_ENV), ignore_errors=True)
os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
