"""Upload an export folder to the Hugging Face Hub (HF_ENDPOINT and HF_TOKEN are honoured).

Nothing waits forever: every request has a timeout, and the whole upload a deadline; a Hub that
cannot be reached, answers with an error or stops answering is one line (HubError: an environment
failure, exit 1); an invalid repo id or folder is bad input (ExportError, exit 2).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import threading
from pathlib import Path
from typing import Optional

from draftsmith.artifacts import CONFIG_NAME, verified_folder
from draftsmith.atomic import MANIFEST_NAME
from draftsmith.runs import log
from draftsmith.export.base import ExportError

# Seconds one request may take to connect or to answer, and the whole upload.
REQUEST_TIMEOUT_S = 60.0
UPLOAD_DEADLINE_S = 3600.0


class HubError(RuntimeError):
    """The Hub could not be reached, refused or stopped answering. The message names the endpoint."""


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _http_client_module():
    """The HTTP library huggingface_hub itself uses: httpx2 from huggingface_hub 2, httpx in 1.x."""
    from huggingface_hub.utils import _http

    return getattr(_http, "httpx2", None) or _http.httpx


def _use_timeouts(seconds: float) -> None:
    """Every request huggingface_hub makes from now on gives up after `seconds` without progress."""
    from huggingface_hub.utils import _http

    http = _http_client_module()
    _http.set_client_factory(
        lambda: http.Client(event_hooks={"request": [_http.hf_request_event_hook]}, follow_redirects=True, timeout=http.Timeout(seconds))
    )


def _explain(err: BaseException, timeout: float) -> Exception:
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError

    where = _endpoint()
    if isinstance(err, HFValidationError):
        return ExportError(f"--repo-id: {str(err).splitlines()[0]}")
    if isinstance(err, HfHubHTTPError):
        status = getattr(getattr(err, "response", None), "status_code", "?")
        return HubError(f"the Hub at {where} refused the upload (HTTP {status}: {str(err).splitlines()[0][:160]})")
    http = _http_client_module()
    if isinstance(err, http.TimeoutException):
        return HubError(f"the Hub at {where} did not answer within {timeout:.0f} s")
    if isinstance(err, (http.TransportError, OSError)):
        return HubError(f"cannot reach the Hub at {where} ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else 'no detail'})")
    return HubError(f"the upload to {where} failed ({type(err).__name__}: {str(err).splitlines()[0][:160]})")


def _uploaded(folder: Path) -> Optional[list[str]]:
    """The files a push uploads: those the export's manifest lists and the manifest (what was
    verified), saying what else lies in the folder and stays behind (a report written beside the
    export, notes); None (the whole folder) where there is no manifest."""
    if not (folder / MANIFEST_NAME).is_file():
        return None
    listed = [*json.loads((folder / MANIFEST_NAME).read_text())["files"], MANIFEST_NAME]
    others = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and str(p.relative_to(folder)) not in listed)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        log(f"note: {len(others)} file(s) in {folder} are not part of the export and stay behind: {shown}", sys.stderr)
    return listed


def push_folder(
    folder: str | Path,
    repo_id: str,
    private: bool = False,
    token: Optional[str] = None,
    timeout: float = REQUEST_TIMEOUT_S,
    deadline: float = UPLOAD_DEADLINE_S,
) -> str:
    """Upload an export folder, verified against its manifest first. Returns the repo URL.
    `timeout`: seconds a request may go without progress; `deadline`: seconds for everything."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        raise ExportError(f"{folder} has no {CONFIG_NAME}: export it first with `draftsmith export`")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise _explain(err, timeout) from None
    verified_folder(folder)
    files = _uploaded(folder)
    _use_timeouts(timeout)
    outcome: dict = {}

    def upload() -> None:
        try:
            api = HfApi(token=token)
            outcome["url"] = str(api.create_repo(repo_id, private=private, exist_ok=True))
            patterns = None if files is None else [glob.escape(name) for name in files]
            api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload draftsmith drafter", allow_patterns=patterns)
        except BaseException as err:  # handed to the caller's thread, which explains it in one line
            outcome["error"] = err

    # The worker is a daemon: past the deadline this process reports and exits without waiting for it.
    worker = threading.Thread(target=upload, daemon=True, name="hub-upload")
    worker.start()
    worker.join(deadline)
    if worker.is_alive():
        raise HubError(f"the upload to {_endpoint()} did not finish within {deadline:.0f} s (the repo may exist without the files; push again)")
    if "error" in outcome:
        raise _explain(outcome["error"], timeout) from None
    return outcome["url"]
