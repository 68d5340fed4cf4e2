"""The format version of every file fsdpbench writes and reads back, declared once.

A JSON file carries ``format_version`` in its top object; a Parquet file in its file-level key-value
metadata. A file without one was written before files carried a version (version 0). Reading a file
checks its version first: one this fsdpbench does not know (newer), or one older than it still reads,
is refused with one line naming the file and the version. Change a file's layout: raise its version
here, and either read the older layout (``oldest`` stays) or refuse it (``oldest`` moves up).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = "format_version"  # the key, in a JSON object and in a Parquet file's metadata
UNVERSIONED = 0  # the version of a file written before files carried one


class FormatVersionError(ValueError):
    """A file's format version is one this fsdpbench does not read: one line naming the file."""


@dataclass(frozen=True, slots=True)
class FileFormat:
    """One kind of file: the version written, the oldest version read, how to make a new one."""

    name: str
    version: int
    oldest: int
    remedy: str  # how to get a file of the current version

    def stamped(self, obj: dict[str, Any]) -> dict[str, Any]:
        """``obj`` with this format's version first."""
        return {FORMAT_VERSION: self.version, **{k: v for k, v in obj.items() if k != FORMAT_VERSION}}

    def check(self, path: str | Path, raw: Any) -> int:
        """The version of the file at ``path`` (``raw``: what it holds under the key, None when absent);
        FormatVersionError when it is not a version this fsdpbench reads."""
        version = UNVERSIONED if raw is None else raw
        if type(version) is not int or version < 0:  # a bool is not a version
            raise FormatVersionError(
                f"{path}: {FORMAT_VERSION} {raw!r} is not a format version (a whole number >= 0)"
            )
        if version > self.version:
            raise FormatVersionError(
                f"{path}: {self.name} {FORMAT_VERSION} {version} is newer than this fsdpbench reads "
                f"({self.version}); read it with the fsdpbench that wrote it, or upgrade"
            )
        if version < self.oldest:
            raise FormatVersionError(
                f"{path}: {self.name} {FORMAT_VERSION} {version} is older than this fsdpbench reads "
                f"(oldest {self.oldest}); {self.remedy}"
            )
        return version

    def check_parquet_metadata(self, path: str | Path, metadata: dict[bytes, bytes] | None) -> int:
        """The version of a Parquet file from its file-level metadata."""
        raw = (metadata or {}).get(FORMAT_VERSION.encode())
        if raw is None:
            return self.check(path, None)
        text = raw.decode("ascii", errors="replace")
        return self.check(path, int(text) if text.isascii() and text.isdigit() else text)

    def parquet_metadata(self) -> dict[bytes, bytes]:
        """The file-level metadata that stamps a Parquet file with this format's version."""
        return {FORMAT_VERSION.encode(): str(self.version).encode()}


# version 0 (no field) and 1 have the same layout: 1 only adds the field
RUN_JSON = FileFormat(name="run.json", version=1, oldest=0, remedy="run the scenario again")
# a baseline of version 2 names each case's host_tuning; one of 0 or 1 does not, and is read with the
# tuning its launcher applied then (analysis.regress.legacy_host_tuning: its provenance's device and
# gloo_loops_idle); version 3 keeps each case's step-time samples by launch, of work CPU time
# (engine/reference.py), and an older version's samples are not comparable with a run's (analysis.regress)
BASELINE = FileFormat(
    name="baseline",
    version=3,
    oldest=0,
    remedy="write one with: fsdpbench regress RUN_DIR --write-baseline PATH",
)
BASELINE_SAMPLES_BY_LAUNCH = 3  # the first baseline version whose step-time samples are by launch
RESULTS = FileFormat(name="results", version=1, oldest=0, remedy="run the scenario again")
# fsdpbench check's files: a machine's measured NVML terms (predict --calibration) and its fits
# boundaries (check --from); none was written before files carried a version
CALIBRATION = FileFormat(
    name="calibration", version=1, oldest=1, remedy="measure one with: fsdpbench check --out DIR"
)
BOUNDARIES = FileFormat(
    name="boundaries", version=1, oldest=1, remedy="measure them again with: fsdpbench check --out DIR"
)
