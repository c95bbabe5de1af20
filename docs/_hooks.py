"""mkdocs hook: the pages link to the repository's own files as ``../path`` (so that they
read on GitHub too); on the site, images under ``benchmarks/results`` are copied in and
every other such link points at the file in the repository."""

import re
from pathlib import Path

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
