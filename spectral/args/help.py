"""The help text of every flag of ServerArgs, by group: the order `--help` shows them in."""

HELP: dict[str, dict[str, str]] = {
    "model": {
        "model_path": "HF model directory, a .gguf file, or 'default' (SmolLM2-135M-Instruct)",
        "model_cache_dir": (
            "where a GGUF's config and tokenizer are extracted, once (default ~/.cache/spectral)"
        ),
        "tokenizer_path": "tokenizer directory (default: the model's)",
        "dtype": (
            "auto (float32 for a GGUF on the CPU integer path, else bf16 where native), "
            "float32, bfloat16, float16"
        ),
        "device": "auto, cpu or cuda",
        "context_length": "override the model's context length",
        "quantization": (
            "gguf: a GGUF model's blocks (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) are "
            "served as they are on the CPU, expanded in registers to exactly the dequantized "
            "values; gguf-int8: the same blocks against activations quantized to 8 bits per 32, in "
            "integer dot products (faster, perplexity within 1%, as llama.cpp); none: every weight "
            "dequantized at load; auto (default): gguf-int8 for a GGUF on a CPU with the CPU "
            "kernels, gguf for a GGUF elsewhere, none for a HF directory (/get_model_info says "
            "which)"
        ),
        "load_format": (
            "auto: the model's weights; dummy: random weights of the model's shape, made on the "
            "device (benchmarks of a shape without its weights; the model directory needs only "
            "config.json and a tokenizer)"
        ),
    },
    "memory and batching": {
        "max_total_tokens": "KV pool size in tokens (default: from --mem-fraction-static)",
        "mem_fraction_static": "fraction of free memory given to the KV pool",
        "max_running_requests": "most requests decoding at once",
        "max_prefill_tokens": "most prompt tokens in one prefill batch",
        "chunked_prefill_size": "prefill long prompts in chunks of this many tokens",
        "schedule_policy": "fcfs (arrival order) or lpm (longest cached prefix first)",
        "enable_mixed_chunk": (
            "a prefill step decodes the running requests too, in the same forward, instead of "
            "a step of its own (one pass over the weights for both)"
        ),
        "disable_radix_cache": "do not share KV between requests with a common prefix",
    },
    "compute": {
        "attention_backend": (
            "auto (CPU: torch; CUDA: flashinfer where installed and the dtype is bfloat16/float16, "
            "else triton), torch, triton (CUDA; on a CPU only under Triton's interpreter, for "
            "tests), flashinfer (CUDA)"
        ),
        "disable_cpu_kernels": "use plain PyTorch matmuls instead of spectral's C++ kernels",
        "random_seed": "seed for unseeded sampling",
        "num_threads": "CPU threads of the model worker (default: torch's, one per core)",
        "disable_cuda_graph": (
            "on a GPU, run decode and verification forwards and the EAGLE and Medusa drafts "
            "eagerly instead of replaying CUDA graphs captured at start"
        ),
        "cuda_graph_max_bs": (
            "largest batch captured in a CUDA graph (default: from the GPU's free memory, at most "
            "--max-running-requests); larger batches run eagerly"
        ),
        "cuda_graph_bs": (
            "the batch sizes captured (e.g. 1 2 4 8; default: 1, 2, 3, 4, 8, 12, 16, 24, then "
            "steps of 8 and 16, up to --cuda-graph-max-bs). On a CPU, given, the same "
            "static-buffer path runs without capture (how it is tested)"
        ),
        "disable_overlap_schedule": (
            "build each plain decode step only after the previous one's tokens are back (by "
            "default on a GPU the next step is launched while the device runs the current one)"
        ),
        "enable_overlap_schedule": (
            "launch plain decode steps ahead on a CPU too (off there by default: no gain)"
        ),
    },
    "speculative decoding": {
        "speculative_algorithm": (
            "EAGLE, EAGLE3 (draft head), STANDALONE (draft model), MEDUSA (Medusa heads), NGRAM or "
            "LOOKAHEAD (no model)"
        ),
        "speculative_draft_model_path": (
            "draft head directory (EAGLE/EAGLE3; 'default' for the head shipped for the default "
            "model), or the draft LM (STANDALONE: a GGUF file or HF directory with the target's "
            "tokenizer)"
        ),
        "speculative_num_steps": "draft tree depth (draft forwards per round)",
        "speculative_eagle_topk": "children kept per expanded node",
        "speculative_num_draft_tokens": (
            "most tree nodes a request verifies per round, the root included (the planner picks "
            "fewer where they do not pay)"
        ),
        "speculative_max_batch_size": (
            "decode plainly when more requests than this run (default: no limit but the planner's; "
            "1 with --speculative-fixed-tree)"
        ),
        "speculative_ngram_min_match_window_size": (
            "NGRAM: shortest suffix match that drafts (default 1 for NGRAM, where no longer suffix "
            "matches; 2 for the hybrids)"
        ),
        "speculative_ngram_max_match_window_size": "NGRAM: longest suffix matched (default 4)",
        "speculative_hybrid_ngram": (
            "EAGLE, EAGLE3, STANDALONE, MEDUSA: n-gram trees of up to N tokens (root included), "
            "verified instead of the drafter's tree for a request and round where the planner "
            "expects more of them (default 8; 0: the drafter drafts every round)"
        ),
        "speculative_hybrid_merge": (
            "with n-gram trees: verify each one together with the head's tree (their union) "
            "instead of in its place"
        ),
        "speculative_hybrid_lookahead": (
            "with n-gram trees beside a drafter: LOOKAHEAD's window and pool join them as a third "
            "source (the --speculative-lookahead-* flags size them)"
        ),
        "speculative_fixed_tree": (
            "every request verifies the full tree every round, up to --speculative-max-batch-size, "
            "instead of trees sized from the cost model"
        ),
        "speculative_disable_grammar_drafts": (
            "do not draft the text a request's grammar forces next (JSON keys and punctuation, a "
            "regex's literals)"
        ),
        "speculative_draft_quantization": (
            "weights of the draft's matmuls on the CPU: q8_0 (GGUF 8-bit blocks, a quarter of "
            "float32's memory traffic), q4_1 (4-bit) or none; for STANDALONE, the draft model's "
            "layers stored in more bits a weight are quantized again at load. auto: q8_0 for a "
            "head, a draft model as stored"
        ),
        "speculative_cost_model": (
            "a cost model JSON to plan trees by instead of measuring one at start-up (cached per "
            "machine under ~/.cache/spectral/cost_models)"
        ),
        "speculative_datastore": (
            "a datastore directory (`spectral datastore build`): the continuations of the "
            "longest suffix it holds draft where the n-grams match nothing (REST); alone with "
            "--speculative-algorithm REST, or beside NGRAM, LOOKAHEAD or a drafter's n-gram trees"
        ),
        "speculative_token_map": (
            "STANDALONE: the token ids the draft model drafts from (FR-Spec; SGLang's torch.save'd "
            "tensor or a JSON list; `spectral token-map` writes one): its LM head keeps only those "
            "rows"
        ),
        "speculative_lookahead_window": (
            "LOOKAHEAD: guessed tokens verified as a Jacobi chain each round (W, default 3)"
        ),
        "speculative_lookahead_ngram": "LOOKAHEAD: n-gram size of its pool (N, default 3)",
        "speculative_lookahead_guesses": (
            "LOOKAHEAD: pool continuations of the root verified each round (G, default 2)"
        ),
    },
    "server": {
        "host": "address to bind (default loopback only)",
        "port": "HTTP port",
        "log_level": "debug, info, warning, error",
        "api_key": "require 'Authorization: Bearer <key>' on every endpoint but /health",
        "served_model_name": "the model name the OpenAI API reports (default: model path)",
        "stream_interval": (
            "a streamed request's new tokens go out every N tokens (its first at once; a "
            "request's own sampling param stream_interval overrides it); a request that does "
            "not stream gets its answer when it finishes"
        ),
    },
    "scale-out": {
        "tp_size": (
            "split the model over N worker processes (tensor parallelism over torch.distributed: "
            "gloo on CPUs, NCCL on GPUs; a GGUF's blocks cut as they load)"
        ),
        "worker_process": (
            "run the model worker in a process of its own beside the scheduler's (always with "
            "--tp-size > 1); by default the scheduler process holds it, as SGLang's does, which "
            "saves a hand-over between processes every step"
        ),
        "nnodes": (
            "machines the --tp-size ranks are spread over (each runs tp_size / nnodes of them; "
            "node 0 also serves HTTP)"
        ),
        "node_rank": "this machine's place among --nnodes (0: the server)",
        "dist_init_addr": (
            "with --nnodes > 1: HOST:PORT of node 0, where the ranks meet (torch.distributed) and, "
            "at PORT + 1, take rank 0's batches"
        ),
        "dp_size": (
            "run N servers (ports after --port, loopback) behind sglang-router on --host:--port "
            "(needs spectral[router])"
        ),
        "worker_urls": (
            "servers elsewhere for the router to use too (URLs separated by commas); with "
            "--dp-size 1 only these"
        ),
        "router_policy": (
            "how the router picks a server: cache_aware (where the prompt's prefix is cached), "
            "round_robin, power_of_two (least loaded of two), random"
        ),
    },
    "request limits": {
        "max_request_bytes": (
            "largest request body accepted (bytes; larger ones get a 413 before they are read)"
        ),
        "max_request_sequences": "most sequences one request may start: prompts times n",
        "max_stop_strings": "most stop strings (and most stop token ids) per request",
        "max_stop_length": "longest stop string, in characters",
        "max_rid_length": "longest request id, in characters",
        "max_top_logprobs_num": (
            "most top logprobs per token (top_logprobs_num, logprobs, top_logprobs)"
        ),
        "grammar_compile_timeout": (
            "seconds a request waits for its regex, json_schema or ebnf to compile before it is "
            "refused (400); compiles run at the lowest priority, beside the model"
        ),
        "grammar_cache_mib": (
            "MiB of compiled grammars kept (least recently used out first; 0 keeps none); a "
            "speculative server's worker keeps as many of its own"
        ),
    },
    "testing": {
        "fault_injection": (
            "testing only: stages (detokenizer, scheduler, worker) that fail for requests whose id "
            "starts with fault-<stage>"
        ),
    },
}
