"""Generation profiles of the session server (tests/conftest.py) and HTTP helpers for the
generations tests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from serve_app.config.profiles import GenerationOptions, Profile

SUPPORT_DRAFT_V1 = {
    "type": "object",
    "properties": {
        "reply": {"type": "string", "maxLength": 24},
        "needs_human_review": {"type": "boolean"},
    },
    "required": ["reply", "needs_human_review"],
    "additionalProperties": False,
}

# The deadline of the support_reply_quick profile: well under the ~1 s its 900 tokens take.
QUICK_DEADLINE_S = 0.4

# An owner silent this long has its generations failed; short so the sweep test is quick.
ORPHAN_AFTER_S = 4.0


# Where the session server keeps its SQLite store (set by generation_options).
SESSION: dict[str, Path] = {}


def generation_options(data_dir: Path) -> GenerationOptions:
    SESSION["data_dir"] = data_dir
    return GenerationOptions(
        data_dir=str(data_dir),
        orphan_after_s=ORPHAN_AFTER_S,
        output_formats={"support_draft_v1": SUPPORT_DRAFT_V1},
        profiles=(
            Profile(
                name="support_reply_v3",
                version="3",
                instructions="You draft short, polite replies to customer support tickets.",
                default_max_output_tokens=16,
                max_output_tokens=400,
                input_budget_tokens=300,
            ),
            # A deadline far shorter than its output allowance takes (the outcome tests'
            # "deadline reached while running").
            Profile(
                name="support_reply_quick",
                instructions="You draft short, polite replies to customer support tickets.",
                default_max_output_tokens=900,
                max_output_tokens=900,
                deadline_s=QUICK_DEADLINE_S,
            ),
            Profile(
                name="support_draft",
                version="1",
                instructions="You draft replies as structured data.",
                output_formats=("support_draft_v1", "text"),
                default_max_output_tokens=96,
                max_output_tokens=128,
            ),
        ),
    )


def poll(url: str, gid: str, until: tuple[str, ...], timeout_s: float = 60.0) -> dict[str, Any]:
    """GET the generation until its status is one of `until`."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = httpx.get(f"{url}/v1/generations/{gid}").json()
        if body["status"] in until or time.monotonic() > deadline:
            return body
        time.sleep(0.05)
