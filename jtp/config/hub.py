"""`--model ORG/NAME`: a Hugging Face repo id resolved to a directory in the HF cache, as vLLM does.

`huggingface_hub.snapshot_download` fetches the files jtp reads (configs, tokenizer, chat template,
safetensors) into the usual cache ($HF_HOME/hub) or finds them there; `HF_HUB_OFFLINE=1` uses the
cache alone. Every failure is a ConfigError that says what to do.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from jtp.errors import ConfigError

# What jtp reads from a checkpoint (no PyTorch .bin, ONNX, GGUF or original/ weights).
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt"]

# huggingface_hub's rule: an optional namespace, a name of word characters, '-' and '.', <= 96 each.
_REPO_ID = re.compile(r"(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}")


def looks_like_repo_id(model: str) -> bool:
    """ORG/NAME or NAME that is not a path someone meant for a local directory."""
    if not _REPO_ID.fullmatch(model) or "--" in model or ".." in model:
        return False
    return not any(part.startswith((".", "-")) or part.endswith((".", "-")) for part in model.split("/"))


def resolve_model(model: str, revision: str | None = None) -> str:
    """The local directory of `model`: itself if it is a directory, else the HF cache's snapshot."""
    if Path(model).is_dir():  # a local directory wins over a repo of the same name (revision unused)
        return model
    if not looks_like_repo_id(model):
        raise ConfigError(f"--model {model}: no such directory")
    return download(model, revision)


@functools.lru_cache(maxsize=None)  # once per process: every later call is the same snapshot
def download(repo_id: str, revision: str | None) -> str:
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
        )
    except ImportError:
        raise ConfigError(f"--model {repo_id}: no such directory (and huggingface_hub, which resolves "
                          "Hugging Face repo ids, is not installed)") from None
    at = f"{repo_id}@{revision}" if revision else repo_id
    offline = constants.HF_HUB_OFFLINE
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=CHECKPOINT_FILES,
                                 local_files_only=offline)
    except GatedRepoError:
        raise ConfigError(f"--model {at}: a gated repo; accept its terms on huggingface.co and log in "
                          "(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"--model {repo_id}: no such directory, and no such Hugging Face repo "
                          "(or it is private: log in with `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"--revision {revision}: {repo_id} has no such branch, tag or commit") from None
    except LocalEntryNotFoundError:
        if offline:
            raise ConfigError(f"--model {at}: no such directory, and not in the Hugging Face cache "
                              f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE=1") from None
        raise ConfigError(f"--model {at}: no such directory, the Hugging Face Hub cannot be reached and the "
                          f"repo is not in its cache ({constants.HF_HUB_CACHE})") from None
    except (HfHubHTTPError, OSError) as e:
        raise ConfigError(f"--model {at}: fetching it from the Hugging Face Hub failed: {' '.join(str(e).split())}") from None
