"""The one thing the tracker needs from W&B's own run file: whether its exit record is on disk.

``run.finish()`` can return before wandb-core has written the run's ``run-<id>.wandb`` transaction log to the end
(seen with wandb 0.31), so :class:`fgrpo.infra.tracking.Tracker` waits for the exit record before it says the run is
closed: a job that copies its run directory right after gets complete files. wandb 0.31 writes that file from Go
and ships no Python reader, so the record framing is read here; the tests read whole runs back with the same
:func:`iter_records` (``tests/helpers/wandb_files.py``).
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path
from typing import Iterator

__all__ = ["has_exit_record", "iter_records", "wait_for_exit_record"]

# The .wandb file is a 7-byte W&B header followed by the LevelDB log format: 32 KiB blocks of
# chunks, each with a 7-byte header (CRC-32 of type byte + payload, little-endian uint32; length,
# uint16; type: 1 full, 2 first, 3 middle, 4 last). Each reassembled record is a serialized
# wandb.proto.wandb_internal_pb2.Record. wandb 0.31 writes it from Go (wandb-core) and ships no
# Python reader, so this is one.
_WANDB_HEADER = struct.Struct("<4sHB")
_WANDB_IDENT, _WANDB_MAGIC, _WANDB_VERSION = b":W&B", 0xBEE1, 0
_BLOCK_SIZE = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_records(data: bytes, source: str, offset: int = 0) -> Iterator[bytes]:
    """Serialized Record messages from a .wandb file's bytes; a cut-off tail (live or crashed run) ends it.

    ``data`` starts at byte ``offset`` of the file: 0, or a block boundary to read only the tail
    (chunks never cross blocks, so a record's leftover middle/last chunks there are skipped).
    """
    if offset % _BLOCK_SIZE:
        raise ValueError(f"offset {offset} is not a multiple of the {_BLOCK_SIZE}-byte block size")
    position = 0
    if offset == 0:
        header = data[: _WANDB_HEADER.size]
        if len(header) < _WANDB_HEADER.size or _WANDB_HEADER.unpack(header) != (_WANDB_IDENT, _WANDB_MAGIC, _WANDB_VERSION):
            raise ValueError(f"{source} is not a W&B transaction log (header {header!r})")
        position = _WANDB_HEADER.size
    pending: bytearray | None = None
    skipping_leftover = offset > 0
    while True:
        left_in_block = _BLOCK_SIZE - position % _BLOCK_SIZE
        if left_in_block < _CHUNK_HEADER.size:  # block trailer padding
            position += left_in_block
            continue
        if position + _CHUNK_HEADER.size > len(data):
            return
        checksum, length, chunk_type = _CHUNK_HEADER.unpack_from(data, position)
        start = position + _CHUNK_HEADER.size
        payload = data[start : start + length]
        if chunk_type == 0 and length == 0:  # zeroed (preallocated) rest of a block
            position += left_in_block
            continue
        if len(payload) < length:
            return
        if zlib.crc32(payload, zlib.crc32(bytes([chunk_type]))) != checksum:
            if start + length >= len(data):
                return  # the last chunk was being written
            raise ValueError(f"{source}: checksum mismatch in the chunk at byte {offset + position}; the file is corrupt")
        position = start + length
        if chunk_type in (_FULL, _FIRST):
            skipping_leftover = False
        if chunk_type == _FULL:
            pending = None
            yield payload
        elif chunk_type == _FIRST:
            pending = bytearray(payload)
        elif chunk_type in (_MIDDLE, _LAST) and pending is not None:
            pending += payload
            if chunk_type == _LAST:
                yield bytes(pending)
                pending = None
        elif not (chunk_type in (_MIDDLE, _LAST) and skipping_leftover):
            raise ValueError(
                f"{source}: unexpected chunk type {chunk_type} at byte {offset + start - _CHUNK_HEADER.size}; "
                "the file is corrupt"
            )


def has_exit_record(path: Path) -> bool:
    """Whether the end of a .wandb file holds the run's exit record (read from its last two blocks only)."""
    from wandb.proto import wandb_internal_pb2

    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            offset = max(0, (size // _BLOCK_SIZE - 1) * _BLOCK_SIZE)
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return False
    for raw in iter_records(data, str(path), offset):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "exit":
            return True
    return False


def wait_for_exit_record(path: Path, timeout_s: float) -> bool:
    """Poll until W&B has written the exit record; ``run.finish()`` can return before wandb-core does."""
    deadline = time.monotonic() + timeout_s
    while not has_exit_record(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
