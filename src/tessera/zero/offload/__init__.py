"""Disk offload of ZeRO's fp32 master weights and optimizer state (``zero.offload = "disk"``), after
DeepSpeed's ZeRO-Infinity NVMe offload: the state lives in memory-mapped files under ``zero.offload_dir``
and the optimizer step streams it through a few chunk buffers, reading the next chunk ahead and writing
the previous one back while the current one is updated (:mod:`.files`, :mod:`.adamw`). The checks a launch
makes before any rank starts are in :mod:`.check`."""

from tessera.zero.offload.adamw import StreamedAdamW, disk_master, for_disk_masters, on_disk, refresh_mirror
from tessera.zero.offload.files import OffloadFolder, chunk_elements

__all__ = ["OffloadFolder", "StreamedAdamW", "chunk_elements", "disk_master", "for_disk_masters", "on_disk",
           "refresh_mirror"]
