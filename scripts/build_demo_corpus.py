"""Build the demo model's training corpus from text that Debian and Python ship offline.

Sources (install them first: `apt-get install python3.11-doc linux-doc debian-handbook manpages
manpages-dev groff-base`):
  - the Python documentation's reStructuredText sources (python3.11-doc)
  - the Linux kernel's documentation (linux-doc), reStructuredText and plain text
  - the Debian Administrator's Handbook, English HTML (debian-handbook), as text
  - man pages of sections 1-8 (manpages, manpages-dev and whatever else the machine has), rendered
    to text with groff
  - the running Python's standard library sources and its test suite (code, docstrings, comments)
  - chat turns made from those: a question about a function, class, module or command, answered
    by the first paragraph of its docstring or man page (so the chat template has something to
    follow)

Every document goes to `train` or `heldout` by a hash of its name (1 in 64 held out), is cut to
at most --max-doc-bytes, and sources are capped so that no single one dominates. Output:
OUT/train.txt, OUT/heldout.txt (documents separated by a line holding only `<|endoftext|>`) and
OUT/sources.json (documents and bytes per source).

    python scripts/build_demo_corpus.py --out out/corpus
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import html.parser
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SEP = "<|endoftext|>"
PY_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
LINUX_DOCS = Path("/usr/share/doc/linux-doc-6.1/Documentation")
HANDBOOK = Path("/usr/share/doc/debian-handbook/html/en-US")
MAN = Path("/usr/share/man")
# pages of a vendor's cloud tools that some machines carry by the thousand: not Debian's
VENDOR_PAGES = ("gcloud", "bq.", "gsutil")


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def python_docs() -> Iterator[tuple[str, str]]:
    for p in sorted(PY_DOCS.rglob("*.txt")):
        yield f"pydoc:{p.relative_to(PY_DOCS)}", read_text(p)


def linux_docs() -> Iterator[tuple[str, str]]:
    for p in sorted(LINUX_DOCS.rglob("*")):
        name = p.name.removesuffix(".gz")
        if p.is_file() and (name.endswith((".rst", ".txt")) or "." not in name):
            text = read_text(p)
            if text.isascii() or sum(ord(c) > 127 for c in text) < len(text) // 50:
                yield f"linux:{p.relative_to(LINUX_DOCS)}", text


class _HtmlText(html.parser.HTMLParser):
    """The visible text of an HTML page, block elements on their own lines."""

    BLOCKS = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "pre", "tr", "dt", "dd",
              "title", "section"}

    def __init__(self) -> None:
        super().__init__()
        self.out: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        if tag in ("script", "style"):
            self.skip += 1
        elif tag in self.BLOCKS:
            self.out.append("\n")

    def handle_endtag(self, tag):  # noqa: ANN001
        if tag in ("script", "style"):
            self.skip -= 1
        elif tag in self.BLOCKS:
            self.out.append("\n")

    def handle_data(self, data):  # noqa: ANN001
        if not self.skip:
            self.out.append(data)


def html_text(src: str) -> str:
    p = _HtmlText()
    p.feed(src)
    text = "".join(p.out)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def handbook() -> Iterator[tuple[str, str]]:
    for p in sorted(HANDBOOK.glob("*.html")):
        yield f"handbook:{p.name}", html_text(read_text(p))


def _render_man(path: Path) -> str:
    raw = read_text(path)
    if raw.lstrip().startswith(".so "):  # a redirect to another page
        return ""
    # no hyphenation, left-adjusted lines (no padding spaces), no overstrikes
    r = subprocess.run(["groff", "-man", "-Tutf8", "-rHY=0", "-dAD=l", "-P-cbou"],
                       input=raw.encode(),
                       capture_output=True, timeout=30,
                       env={**os.environ, "GROFF_NO_SGR": "1"})
    return re.sub(r"\n{3,}", "\n\n", r.stdout.decode("utf-8", errors="replace"))


def man_pages(limit: int, seed: int) -> Iterator[tuple[str, str]]:
    pages = sorted(p for s in range(1, 9) for p in (MAN / f"man{s}").glob("*")
                   if p.is_file() and not p.name.startswith(VENDOR_PAGES))
    random.Random(seed).shuffle(pages)
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        for p, text in zip(pages[:limit], pool.map(_render_man, pages[:limit]), strict=True):
            if len(text) > 200:
                yield f"man:{p.name}", text


def stdlib_sources() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] in ("site-packages", "idlelib", "lib2to3"):
            continue
        yield f"stdlib:{rel}", p.read_text(encoding="utf-8", errors="replace")


def first_paragraph(text: str, limit: int = 600) -> str:
    para = text.strip().split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines())
    return para[:limit].rsplit(" ", 1)[0] if len(para) > limit else para


def chat(question: str, answer: str) -> str:
    """One exchange in the demo model's chat format (ChatML, as its template renders it)."""
    return (f"<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n{answer}<|im_end|>\n")


def stdlib_chats() -> Iterator[tuple[str, str]]:
    """Questions about the standard library's modules, classes and functions, answered by the
    first paragraph of their docstrings."""
    for name, src in stdlib_sources():
        module = name.removeprefix("stdlib:").removesuffix(".py").replace("/", ".")
        module = module.removesuffix(".__init__")
        if module.split(".")[-1].startswith("_") or module.startswith("test."):
            continue
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 40:
            yield (f"chat:{module}", chat(f"What is the Python module {module} for?",
                                          first_paragraph(doc)))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    yield (f"chat:{module}.{node.name}",
                           chat(f"What does the {kind} {module}.{node.name} do?",
                                first_paragraph(doc)))


def man_chats(pages: list[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """'What is CMD?' answered by a man page's NAME line and the first paragraph of its
    DESCRIPTION."""
    for name, text in pages:
        m = re.search(r"^NAME\n\s+(.+?)\n\n", text, re.M | re.S)
        d = re.search(r"^DESCRIPTION\n(.+?)\n\n", text, re.M | re.S)
        if not m or not d:
            continue
        cmd = name.removeprefix("man:").split(".")[0]
        answer = " ".join(m.group(1).split()) + ". " + " ".join(d.group(1).split())
        yield f"chat:man:{name}", chat(f"What is {cmd}?", answer[:700])


def held_out(name: str) -> bool:
    return hashlib.sha256(name.encode()).digest()[0] % 64 == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-doc-bytes", type=int, default=200_000)
    ap.add_argument("--man-pages", type=int, default=6000, help="man pages rendered at most")
    ap.add_argument("--cap-mb", type=float, default=60.0, help="bytes kept of each source")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    man = list(man_pages(a.man_pages, a.seed))
    sources = {"python-docs": python_docs(), "linux-docs": linux_docs(), "handbook": handbook(),
               "man": iter(man), "stdlib": stdlib_sources(),
               "chat": (d for g in (stdlib_chats(), man_chats(man)) for d in g)}
    counts: dict[str, dict[str, int]] = {}
    with open(a.out / "train.txt", "w") as train, open(a.out / "heldout.txt", "w") as held:
        for source, docs in sources.items():
            n = size = 0
            for name, text in docs:
                text = text.replace(SEP, "").strip()[: a.max_doc_bytes]
                if not text or size > a.cap_mb * 1e6:
                    continue
                (held if held_out(name) else train).write(text + f"\n{SEP}\n")
                n, size = n + 1, size + len(text)
            counts[source] = {"documents": n, "bytes": size}
            print(f"{source}: {n} documents, {size / 1e6:.1f} MB", file=sys.stderr)
    (a.out / "sources.json").write_text(json.dumps(counts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
