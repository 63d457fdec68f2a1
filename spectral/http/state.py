"""What the routes serve from: one `Serving` per app, kept on `app.state` and handed to each
route through a FastAPI dependency (`ServingDep`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib.metadata import version
from typing import Annotated, Any

from fastapi import Depends, Request

from spectral.args import ServerArgs
from spectral.core.model import ResolvedModel
from spectral.http.protocol import RequestLimits
from spectral.http.tokenizer_manager import TokenizerManager


@dataclass
class Serving:
    """The tokenizer manager, the name the model is served under, what the info endpoints say
    besides the scheduler's state, and the limits every request is held to."""

    manager: TokenizerManager
    served_model: str
    info: dict[str, Any]
    limits: RequestLimits


def serving(request: Request) -> Serving:
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(serving)]


def server_info(args: ServerArgs, model: ResolvedModel, num_kv_slots: int) -> dict[str, Any]:
    """What /get_server_info and /get_model_info say besides the scheduler's state, in SGLang's
    names (sglang-router reads the sizes and the model's names from them)."""
    public_args = {k: v for k, v in dataclasses.asdict(args).items() if k != "api_key"}
    return {
        "model_path": args.model_path,
        "served_model_name": args.served_model_name or args.model_path,
        "tokenizer_path": model.tokenizer_dir,
        "model_type": model.model_type,
        "architectures": [model.architecture],
        "features": model.features,
        # how the weights are served (--quantization as resolved: auto says which)
        "quantization": args.resolved_quantization(model.gguf_file is not None),
        "dtype": str(args.resolved_dtype(model.gguf_file is not None)).removeprefix("torch."),
        "context_length": model.context_len,
        "max_total_tokens": num_kv_slots,
        "tp_size": 1,
        "dp_size": 1,
        "version": version("spectral"),
        "server_args": public_args,
    }
