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


def parse_size(text: str) -> int:
    """Bytes from `123`, `500M`, `4G` (powers of 1024); ValueError otherwise."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    unit = t[-1] if t and t[-1] in "KMG" else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 4G or 500M") from None
