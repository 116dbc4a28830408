"""What both profilers share: the profile-directory guard, one process per GPU, merging their files."""
from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from substation.errors import SubstationError
from substation.records import RecordWriter, read_rows
from substation.sizes import Size

log = logging.getLogger(__name__)


class ProfileDirError(SubstationError, ValueError):
    """A profile file holds rows of another size or GPU."""


def gpu_name(device: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def versions() -> dict[str, str]:
    """torch, CUDA, cuBLASLt, driver and substation versions, stamped on every row."""
    import torch
    from cuda.bindings import driver
    from nvmath.bindings import cublasLt

    from substation.version import __version__

    _, driver_version = driver.cuDriverGetVersion()
    return {"torch": torch.__version__, "cuda": str(torch.version.cuda), "cublasLt": str(cublasLt.get_version()),
            "driver": str(driver_version), "substation": __version__}


def check_profile_dir(path: Path, size: Size, gpu: str, force: bool) -> None:
    """Refuse to append rows of another size or GPU to an existing file, unless forced to start anew."""
    if not path.exists() or path.stat().st_size == 0:
        return
    clash = next((r for r in read_rows(path) if r.size.dims() != size.dims() or r.gpu != gpu), None)
    if clash is None:
        return
    if not force:
        raise ProfileDirError(f"{path} holds rows for {clash.size.dims()} on {clash.gpu!r}, not {size.dims()} on "
                              f"{gpu!r}; use another --out, or --force to start a new file")
    backup = path.with_suffix(".csv.old")
    path.replace(backup)
    log.warning("moved %s to %s (--force)", path, backup)


def run_on_gpus(worker: Callable[..., None], shards: Sequence[tuple], path: Path, gpus: Sequence[int]) -> None:
    """worker(*shard, path, gpu, position) for each GPU: in-process for one, else one spawned process per
    GPU, each writing a part file, merged into `path` at the end."""
    if len(gpus) == 1:
        worker(*shards[0], path, gpus[0], 0)
        return
    parts = [path.with_suffix(f".gpu{g}.csv") for g in gpus]
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with context.Pool(len(gpus)) as pool:
        pool.starmap(worker, [(*shard, part, g, i) for i, (shard, part, g) in enumerate(zip(shards, parts, gpus))])
    merge(parts, path)


def merge(parts: Sequence[Path], path: Path) -> None:
    """Append the rows of per-GPU part files to `path` (skipping keys it has), then remove the parts."""
    with RecordWriter(path) as writer:
        for part in parts:
            if part.exists():
                for row in read_rows(part):
                    if row.key not in writer:
                        writer.write(row)
    for part in parts:
        if part.exists():
            os.remove(part)
