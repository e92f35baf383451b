"""Sizes: human-readable for log lines, and read from Linux's /proc files."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def proc_kib(path: str, key: str) -> int | None:
    """A `Key:   N kB` field of a /proc file, in bytes; None where the file or field is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
