"""docs/architecture.md names every module of the packages it describes, each in its package's
paragraph, and no module that does not exist; every dotted name a doc gives of our code
(`edge.serve.load_settings`) is there to import; the README's list of proxied routes is the
app's."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("transport", "edge", "backends", "certs", "bench", "tools")
_PARAGRAPH = re.compile(r"^\*\*`([\w/]+)/`", re.M)


def paragraphs(text: str) -> dict[str, str]:
    """Each package's paragraph ("**`edge/models/`: which model.** ..."), by package path."""
    starts = [(m.start(), m.group(1)) for m in _PARAGRAPH.finditer(text)]
    ends = [start for start, _ in starts[1:]] + [text.find("\n## ", starts[-1][0])]
    return {package: text[start:end] for (start, package), end in zip(starts, ends, strict=True)}


def modules() -> list[Path]:
    return sorted(
        path.relative_to(ROOT)
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts
    )


def home(module: Path, described: set[str]) -> str:
    """The most specific package with a paragraph that holds `module`."""
    parents = [str(parent) for parent in module.parents if str(parent) in described]
    assert parents, f"{module}: no paragraph for its package"
    return parents[0]


def named(module: Path, paragraph: str, page: str = "") -> bool:
    """Whether `paragraph` names `module` (`tls.py`), or the page its whole path."""
    if f"`{module.as_posix()}`" in page or f"({module.as_posix()}" in page:
        return True
    if module.parts[0] == "tools":  # run as `python -m tools.NAME`: named by that NAME
        return f"`{module.stem}`" in paragraph or f"tools.{module.stem}" in paragraph
    return re.search(rf"(?<![\w.]){re.escape(module.name)}\b", paragraph) is not None


def test_every_module_is_named_in_its_packages_paragraph() -> None:
    text = DOC.read_text()
    found = paragraphs(text)
    missing = [str(m) for m in modules() if not named(m, found[home(m, set(found))], text)]
    assert missing == [], "modules docs/architecture.md does not describe"


def test_every_module_it_names_exists() -> None:
    found = paragraphs(DOC.read_text())
    absent = []
    for package, paragraph in found.items():
        for name in set(re.findall(r"(?<![\w.])([\w/]+\.py)\b", paragraph)):
            if "/" in name:
                if not (ROOT / name).exists() and not (ROOT / package / name).exists():
                    absent.append(f"{package}: {name}")
            elif not any((ROOT / package).rglob(name)):
                absent.append(f"{package}: {name}")
    assert absent == [], "modules docs/architecture.md names that are not there"


def dotted_names() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pattern = re.compile(rf"`((?:{'|'.join(PACKAGES)})\.[A-Za-z_][\w.]*)")
    return [
        (page.name, name.rstrip("."))
        for page in pages
        for name in sorted(set(pattern.findall(page.read_text())))
        if name.rsplit(".", 1)[-1] not in ("py", "md", "toml")
    ]


def resolves(name: str) -> bool:
    """Whether `name` is a module, or a module's attribute (a class's, ...)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize(("page", "name"), dotted_names())
def test_a_dotted_name_the_docs_give_exists(page: str, name: str) -> None:
    assert resolves(name), f"{page}: `{name}` is not in the code"


def test_the_checks_can_fail() -> None:
    assert not resolves("edge.serve.no_such_thing") and resolves("edge.serve.load_settings")
    paragraph = "**`transport/`: bytes.** `tls.py` the certificate"
    assert named(Path("transport/tls.py"), paragraph)
    assert not named(Path("transport/redacted.py"), paragraph)


def test_the_readme_names_every_route_the_edge_forwards() -> None:
    from edge.app import ROUTE_METHODS

    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    listed = text[text.index("Proxied routes:") :].split(";", 1)[0]
    assert [route for route in ROUTE_METHODS if f"`{route}`" not in listed and
            f"`POST {route}`" not in listed] == []  # fmt: skip
