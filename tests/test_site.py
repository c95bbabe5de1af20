"""The built documentation site as a reader sees it: the API reference page.

The site is built once per test process, into a temporary directory (mkdocs, not strict:
the build's warnings are one test, and every other test looks at the page a non-strict
build leaves), and ``api/index.html`` is read with ``html.parser``: every docstring example
is a code block, no Sphinx role is left raw, every documented parameter has a row of its own
with its type and is one of the signature's, every cross-reference resolves, and every
public name is on the page.
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parent.parent
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
ROLE = re.compile(r":(?:py:)?(?:func|class|attr|data|meth|mod|obj|exc|const|ref):(?:`|<code)")
NAMED = {"Parameters:", "Other Parameters:", "Attributes:"}  # sections whose rows are named
TYPED = {"Parameters:", "Other Parameters:"}  # ... and whose types a signature gives
NAME = re.compile(r"\*{0,2}[A-Za-z_]\w*")


class Node:
    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children = tag, dict(attrs), []

    @property
    def classes(self):
        return (self.attrs.get("class") or "").split()

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)


class TreeBuilder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = [Node("#document", {})]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs)
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:  # a stray end tag closes nothing
                del self.stack[i:]
                break

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def walk(node, in_pre=False):
    """Yields ``(node_or_text, in_pre)`` below ``node`` in document order."""
    for child in node.children:
        yield child, in_pre
        if isinstance(child, Node):
            yield from walk(child, in_pre or child.tag == "pre")


@dataclass
class Documented:
    """What the page shows of one documented object, up to the next object's heading."""

    signature: str | None = None
    code: list = field(default_factory=list)  # texts inside <pre>
    prose: list = field(default_factory=list)  # texts outside <pre>
    rows: list = field(default_factory=list)  # (section title, [cell texts]) of each table row
    blockquotes: int = 0


@dataclass(repr=False)  # not the whole page in a failure's traceback
class Page:
    html: str
    ids: set = field(default_factory=set)
    hrefs: list = field(default_factory=list)
    objects: dict = field(default_factory=dict)  # heading id -> Documented

    @classmethod
    def parse(cls, html):
        builder = TreeBuilder()
        builder.feed(html)
        builder.close()
        page, document = cls(html), builder.stack[0]
        article = document  # the page's own content: not the navigation, footer or scripts
        for node, _ in walk(document):
            if isinstance(node, Node):
                page.ids.add(node.attrs.get("id"))
                if node.attrs.get("href", "").startswith("#"):
                    page.hrefs.append(node.attrs["href"][1:])
                if node.tag == "article" and article is document:
                    article = node
        current, section = None, None
        for node, in_pre in walk(article):
            if isinstance(node, str):
                if current is not None and node.strip():
                    (current.code if in_pre else current.prose).append(node)
            elif "doc-heading" in node.classes and node.attrs.get("id"):
                current = page.objects[node.attrs["id"]] = Documented()
                section = None
            elif current is None:
                continue
            elif "doc-signature" in node.classes and current.signature is None:
                current.signature = node.text()
            elif "doc-section-title" in node.classes:
                section = node.text().strip()
            elif node.tag == "tr" and "doc-section-item" in node.classes:
                cells = [c for c in node.children if isinstance(c, Node) and c.tag == "td"]
                current.rows.append((section, [" ".join(c.text().split()) for c in cells]))
            elif node.tag == "blockquote":
                current.blockquotes += 1
        return page


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """``(build log, API page)`` of a fresh build of this checkout's site."""
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--no-strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,  # a hang's limit: far beyond a loaded 2-core machine's build
    )
    assert run.returncode == 0, f"mkdocs build failed:\n{run.stdout}{run.stderr[-4000:]}"
    return run.stdout + run.stderr, (site / "api" / "index.html").read_text()


@pytest.fixture(scope="module")
def page(build):
    page = Page.parse(build[1])
    assert len(page.objects) >= 20, f"the API page documents {sorted(page.objects)} only"
    return page


@pytest.fixture(scope="module")
def package():
    """jaxga as griffe reads it for the page: statically, from this checkout."""
    return griffe.load("jaxga", search_paths=[str(ROOT)], resolve_aliases=False)


def docstring_prompts(package, path):
    """The ``>>>`` lines of the docstring(s) the page shows for ``path`` (a class's own
    ``__init__``'s merged into its own), or None if ``path`` is not jaxga's."""
    try:
        obj = package[path.removeprefix("jaxga.")]
    except KeyError:
        return None
    docs = [obj.docstring]
    if obj.is_class and "__init__" in obj.members:
        docs.append(obj.members["__init__"].docstring)
    lines = "\n".join(d.value for d in docs if d is not None).splitlines()
    return sum(line.lstrip().startswith(">>>") for line in lines)


def test_build_has_no_warnings(build):
    warnings = [line for line in build[0].splitlines() if "WARNING" in line]
    assert not warnings, "the docs build warns (a strict build fails):\n" + "\n".join(warnings)


def test_no_raw_sphinx_roles(page):
    roles = sorted({m.group(0) for m in ROLE.finditer(page.html)})
    assert not roles, (
        f"Sphinx roles shown raw on the API page: {roles}; write [`x`][jaxga.x] or `x`"
    )


def test_examples_are_code_blocks(page, package):
    problems = []
    for path, shown in page.objects.items():
        loose = [t for t in shown.prose if ">>>" in t]
        if loose:
            problems.append(f"{path}: `>>>` outside a code block: {loose[0].strip()[:80]!r}")
        if shown.blockquotes:
            problems.append(f"{path}: {shown.blockquotes} <blockquote>s (`>>>` read as quotes?)")
        expected = docstring_prompts(package, path)
        in_code = sum(
            line.lstrip().startswith(">>>") for t in shown.code for line in t.splitlines()
        )
        if expected is not None and in_code != expected:
            problems.append(
                f"{path}: {expected} `>>>` lines in its docstring, {in_code} in code blocks on "
                "the page (an examples section is headed `Examples:`)"
            )
    assert not problems, "docstring examples not shown as code:\n" + "\n".join(problems)


def test_each_parameter_has_a_typed_row_of_its_own(page):
    problems, checked = [], 0
    for path, shown in page.objects.items():
        for section, cells in shown.rows:
            if section not in NAMED:
                continue
            checked += 1
            name = cells[0]
            if not NAME.fullmatch(name):
                problems.append(f"{path}: {section[:-1]} row named {name!r}: one name a row")
                continue
            if section not in TYPED:
                continue
            if shown.signature is None:
                problems.append(f"{path}: documents {name!r} but shows no signature")
            elif not re.search(rf"(?<![\w.]){re.escape(name)}\b", shown.signature):
                problems.append(f"{path}: {name!r} is not in its signature {shown.signature!r}")
            if len(cells) < 2 or not cells[1]:
                problems.append(f"{path}: parameter {name!r} has no type (annotate it)")
    assert checked, "no parameter rows found on the API page: is it still rendered as tables?"
    assert not problems, "parameters not shown one per row:\n" + "\n".join(problems)


def test_cross_references_resolve(page):
    dangling = sorted({h for h in page.hrefs if h and h not in page.ids})
    assert not dangling, f"links to anchors missing from the API page: {dangling}"
    raw = [
        f"{path}: {m.group(0)}"
        for path, shown in page.objects.items()
        for m in re.finditer(r"\[[^\[\]\n]*\]\[[\w.]*\]", "".join(shown.prose))
    ]
    assert not raw, "cross-references left as text (unresolved):\n" + "\n".join(raw)


def test_public_names_are_on_the_page(page, package):
    public = [str(name) for name in package.exports] + ["collectives"]  # `import ... as ...`
    missing = []
    for name in public:
        path, obj = f"jaxga.{name}", package[name]
        if not obj.is_module:
            missing += [] if path in page.objects else [path]
        elif obj.exports:
            missing += [
                f"{path}.{n}" for n in map(str, obj.exports) if f"{path}.{n}" not in page.objects
            ]
        elif not any(shown.startswith(f"{path}.") for shown in page.objects):
            missing.append(f"{path}.*")
    assert not missing, f"public names missing from the API page (docs/api.md): {missing}"
