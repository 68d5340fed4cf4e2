"""Imported by the fork server only, last of its preloads (launch.py): moves every object the preloads
created (torch's modules, pandas', fsdpbench's: hundreds of thousands) out of the cyclic garbage
collector's sight, for the fork server and every process it forks. A rank's or the traced predictor's
allocation-heavy Python (parsing the profiled step's Chrome trace, its intervals) otherwise set off
collections that walked that whole heap again and again: a rank's trace analysis took 0.4-0.7 s, of
which 0.05 s was the analysis. Objects created later are collected as usual. Nothing else imports this
module."""

import gc

gc.freeze()
