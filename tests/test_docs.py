"""The documentation's pointers and lists against the code: every pointer
to a README section, a docs page or an anchor names one that exists, and
the lists of flags every worker must share (README, docs/deploying.md) are
the settings TrainConfig declares WORKERS, which the handshake compares."""

import pathlib
import re

import pytest

from trainer.common import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("trainer", "tests", "deploy")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation
    other than - and _ dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: pathlib.Path) -> list[str]:
    return [line.lstrip("#").strip() for line in
            path.read_text().splitlines() if re.match(r"#{1,6} ", line)]


def joined(path: pathlib.Path) -> str:
    """The file with strings cut over lines ("a "\\n "b") and comment
    continuations joined, whitespace collapsed: pointers span lines."""
    text = re.sub(r"[\"']\s*\n\s*f?[\"']", "", path.read_text())
    text = re.sub(r"\n\s*#\s*", " ", text)
    return re.sub(r"\s+", " ", text)


def code_files() -> list[pathlib.Path]:
    files = [p for top in SOURCES for p in (ROOT / top).rglob("*")
             if p.suffix in (".py", ".sh", ".yaml", "") and p.is_file()
             and "__pycache__" not in p.parts
             and p != pathlib.Path(__file__).resolve()]
    return files + sorted(ROOT.glob("*.sh"))


def pointers(text: str) -> list[tuple[str, str | None]]:
    """(file relative to the root, anchor or None) for docs/x.md#anchor,
    "README's X section" and "README, X" in `text`."""
    found = [(m[1], m[2] or None) for m in re.finditer(
        r"\b((?:docs/)?[\w-]+\.md)(?:#([\w-]+))?", text)]
    found += [("README.md", slug(m[1])) for m in re.finditer(
        r"README[’']s ([^.;()]+?) section", text)]
    found += [("README.md", slug(m[1])) for m in re.finditer(
        r"README, ([A-Z][\w ]*?)[).;]", text)]
    return found


def check(pointer: tuple[str, str | None], base: pathlib.Path,
          where: pathlib.Path) -> str | None:
    name, anchor = pointer
    # A bare page name ("deploying.md") in the code is a docs page.
    target = next((t for t in (base / name, ROOT / name, ROOT / "docs" / name)
                   if t.exists()), None)
    if target is None:
        return f"{where.relative_to(ROOT)}: {name} does not exist"
    if anchor and anchor not in {slug(h) for h in headings(target)}:
        return f"{where.relative_to(ROOT)}: {name} has no section #{anchor}"
    return None


def test_pointers_in_the_code_name_existing_sections():
    problems = [check(p, ROOT, path) for path in code_files()
                for p in pointers(joined(path))]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


def test_links_in_the_docs_name_existing_sections():
    problems = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "deploy").glob("*.md"))]:
        for m in re.finditer(r"\]\(([^)#\s]*)(?:#([\w-]+))?\)",
                             path.read_text()):
            if m[1].startswith(("http:", "https:")):
                continue
            name = m[1] or path.name
            problems.append(check((name, m[2]), path.parent, path))
        problems += [check(p, ROOT, path) for p in pointers(
            re.sub(r"\]\([^)]*\)", "]", path.read_text()))
            if p[0].startswith("docs/") or p[0] == "README.md"]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page, opening", [
    ("README.md", "Every worker must get the same training flags"),
    ("docs/deploying.md", "Every worker must be given the same training flags"),
])
def test_the_docs_list_the_flags_every_worker_must_share(page, opening):
    declared = set(config.shared_names(config.WORKERS))
    text = re.sub(r"\s+", " ", (ROOT / page).read_text())
    sentence = re.search(re.escape(opening) + r" \(([^)]*)\)", text)
    assert sentence, f"{page} no longer lists the shared flags"
    listed = set(re.findall(r"`--(\w+)`", sentence[1]))
    # --epochs too: it comes to train_steps, compared as resolved.
    assert "epochs" in listed and "train_steps" in declared
    assert listed - {"epochs"} == declared, (
        f"{page} lists {sorted(listed - {'epochs'} - declared)} beyond the "
        f"WORKERS fields of TrainConfig, and lacks "
        f"{sorted(declared - listed)}")
