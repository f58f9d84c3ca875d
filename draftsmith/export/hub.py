"""Upload an export folder to the Hugging Face Hub (HF_ENDPOINT and HF_TOKEN are honoured)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from draftsmith.artifacts import CONFIG_NAME, verified_folder
from draftsmith.export.base import ExportError


def push_folder(folder: str | Path, repo_id: str, private: bool = False, token: Optional[str] = None) -> str:
    """Upload an export folder, verified against its manifest first. Returns the repo URL."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        raise ExportError(f"{folder} has no {CONFIG_NAME}: export it first with `draftsmith export`")
    verified_folder(folder)
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload draftsmith drafter")
    return str(url)
