"""mkdocs hook, and a griffe extension for the API reference.

The hook: the pages link to the repository's own files as ``../path`` (so that they read on
GitHub too); on the site, images under ``benchmarks/results`` are copied in and every other
such link points at the file in the repository.

The extension (``NewAsInit``, named in mkdocs.yml's mkdocstrings options): griffe takes a
class's signature and parameters from its ``__init__`` only, so a class built by
``__new__`` (``jaxga.MultiSteps``, an optax ``NamedTuple``) would show no signature and
warn that each of its documented arguments "does not appear in the function signature".
"""

import re
from pathlib import Path

import griffe
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
FIGURES = "benchmarks/results"
LINK = re.compile(r"\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")


def on_files(files, config):
    for png in sorted((ROOT / FIGURES).glob("*.png")):
        rel = png.relative_to(ROOT).as_posix()
        files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    blob = config["repo_url"].rstrip("/") + "/blob/main/"

    def point(match):
        path, anchor = match.group(1), match.group(2) or ""
        if path.startswith(FIGURES) and path.endswith(".png"):
            return f"]({'../' * page.file.src_uri.count('/')}{path})"
        return f"]({blob}{path}{anchor})"

    return LINK.sub(point, markdown)


class NewAsInit(griffe.Extension):
    """Gives a class that defines ``__new__`` but no ``__init__`` an ``__init__`` with the
    parameters of its ``__new__``, which is what calling the class takes."""

    def on_package(self, *, pkg, **kwargs):
        classes = [pkg]
        while classes:
            obj = classes.pop()
            for member in obj.members.values():
                if not member.is_alias and (member.is_module or member.is_class):
                    classes.append(member)
            if obj.is_class and "__new__" in obj.members and "__init__" not in obj.members:
                new = obj.members["__new__"]
                parameters = [  # copies: a function takes its parameters as its own
                    griffe.Parameter(
                        p.name, annotation=p.annotation, kind=p.kind, default=p.default
                    )
                    for p in new.parameters  # `cls` first, in `self`'s place
                ]
                init = griffe.Function(
                    "__init__",
                    lineno=new.lineno,
                    endlineno=new.endlineno,
                    parent=obj,
                    parameters=griffe.Parameters(*parameters),
                    returns="None",
                )
                obj.set_member("__init__", init)
