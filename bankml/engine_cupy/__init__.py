"""bankml's native engine: a GGUF model run in-process, with llama-server's arithmetic on the CPU.

What is inside, from the request down:

- ``engine``: ``Engine`` (one resident model, its slots): parse a request, tokenize, prefill in
  micro-batches, sample, stream; ``compile_kernels`` for a start-up that compiles while hashing;
- ``request``: ``Request``, ``RequestError`` and the request fields read as llama-server reads
  them; ``stops``: the text a run releases (UTF-8, stop strings, line limits);
- ``schedule``: a run's protocol with whatever drives it (``Forward``, ``Waiting``, ``Steps``,
  ``Chunk``, ``Progress``, ``Summary``, ``Slot``, ``SharedPrompt``); ``passes``: which
  micro-batches of one iteration are computed together;
- ``tokenizer``, ``unicode_classes``, ``chat_template``: the GGUF vocabulary and template;
- ``sampler``, ``grammar``: llama-server's sampler chain and constrained decoding;
- ``prompt_cache``, ``checkpoints``, ``slots``: the host prompt cache, the sliding-window
  context checkpoints, slot files;
- ``model``: the transformer, written once (attention, feed-forward, the block, the stack), and
  ``Model``; ``exact_backend`` and ``array_backend``: the two backends it runs on (the exact CPU
  kernels; vectorised NumPy/CuPy), one chosen at load;
- ``weights``, ``arch``: reading GGUF tensors and hyperparameters, what differs per architecture;
- ``kv_cache``: the f16 or q8_0 K/V cache (and gemma3's sliding-window ring);
- ``encoder``: BERT's hidden states (``Encoder``), llama-server's bits, for embeddings;
- ``backend``: NumPy or CuPy, and the CPU BLAS thread count;
- ``kernels``: the exact CPU kernels, compiled by Numba (products, attention, element-wise
  steps, the fused decode step), and compile progress reporting.

Importing any of it starts no thread and reads no environment variable: configuration (cache
type, host cache size, device) is passed to ``Engine.open``; the kernels' worker threads start
when a model is loaded, on the loading thread.
"""
