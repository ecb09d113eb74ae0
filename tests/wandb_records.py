"""W&B's offline `.wandb` files read without wandb's reader: the records the export wrote, for the export tests."""

from __future__ import annotations


def wandb_records(data: bytes) -> list[bytes]:
    """The records of a `.wandb` file: W&B's log format (a 7-byte header, then LevelDB-style 32 KiB blocks of
    chunks, each a 4-byte checksum, 2-byte length and 1-byte type: full, first, middle, last)."""
    block, pos, partial, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind in (2, 3):
            partial = (b"" if kind == 2 else partial) + chunk
        elif kind == 4:
            out.append(partial + chunk)
    return out
