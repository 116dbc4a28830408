"""What both profilers share: the GPU name and versions stamped on rows, the profile-directory guard. Their
workers run in isolation (`substation.isolation`)."""
from __future__ import annotations

import gzip
import logging
import math
import shutil
from pathlib import Path

import torch

from substation.errors import SubstationError
from substation.records import read_rows
from substation.sizes import Size
from substation.version import __version__

log = logging.getLogger(__name__)


class ProfileDirError(SubstationError, ValueError):
    """A profile file holds rows of another size, GPU or dropout."""


def gpu_name(device: int) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def versions() -> dict[str, str]:
    """torch, CUDA, cuBLASLt, driver and substation versions, stamped on every row."""
    from cuda.bindings import driver  # optional GPU packages
    from nvmath.bindings import cublasLt

    _, driver_version = driver.cuDriverGetVersion()
    return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "cublasLt": str(cublasLt.get_version()),
            "driver": str(driver_version), "substation": __version__}


def _dropout_text(dropout: float | None) -> str:
    return "no dropout" if dropout is None or math.isnan(dropout) else f"dropout {dropout:g}"


def unpack(path: Path) -> None:
    """Where only `<path>.gz` exists (a profile as shipped), unpack it into `path` and remove it, so that a run can
    extend or edit the file."""
    packed = path.with_name(path.name + ".gz")
    if not path.exists() and packed.is_file():
        with gzip.open(packed, "rb") as source, open(path, "wb") as target:
            shutil.copyfileobj(source, target)
        packed.unlink()
        log.warning("unpacked %s into %s to extend it (gzip it again to ship it)", packed, path.name)


def check_profile_dir(path: Path, size: Size, gpu: str, dropout: float | None, force: bool) -> set[str]:
    """Refuse to append rows of another size, GPU or dropout probability (None: a run without dropout) to an
    existing file, unless forced to start anew; the keys of the rows a run resumes from (none in a new file). A
    profile kept compressed (`<path>.gz`, as shipped) is unpacked into `path` first, so a run extends it (a
    directory holding both would be refused by the optimizer)."""
    unpack(path)
    if not path.exists() or path.stat().st_size == 0:
        return set()
    rows = read_rows(path)
    wanted = _dropout_text(dropout)
    clash = next((r for r in rows if r.size.dims() != size.dims() or r.gpu != gpu
                  or _dropout_text(r.dropout) != wanted), None)
    if clash is None:
        return {row.key for row in rows}
    if not force:
        raise ProfileDirError(f"{path} holds rows for {clash.size.dims()} on {clash.gpu!r} at "
                              f"{_dropout_text(clash.dropout)}, not {size.dims()} on {gpu!r} at {wanted}; use "
                              f"another --out, or --force to start a new file")
    backup = path.with_suffix(".csv.old")
    path.replace(backup)
    log.warning("moved %s to %s (--force)", path, backup)
    return set()
