"""Engines across GPUs (issue 27): one engine graph per rank, run by one process per rank.

Where each part lives:
- `mapping.py`: `RankMapping`, the one object that answers every rank question (tp / pp / expert rank, groups,
  previous / next stage, which layers, which experts, how many heads), with TensorRT-LLM's formulas
  (tensorrt_llm/mapping.py). No other code does rank arithmetic.
- `toolchain/engine/collectives.py`: the collective plugin ops (`trtbuild::AllReduce`, `AllGather`, `Send`,
  `Recv`), their attributes, the `Communicator` protocol that runs them, `LocalComm` (world 1) and `ThreadComm`
  (ranks as threads, for fast tests).
- engine/export.py and engine/build.py: per-rank export and build (`ENGINE/rank{r}/model.onnx`, each rank
  reading only its own shard).
- `comm.py`, `worker.py`, `engine.py`, `launch.py`: the process model. Rank 0 is the caller's process (scheduler,
  server) and drives a rank-0 facade that implements the runtime's `Engine` protocol; ranks 1.. are spawned
  worker processes (or torchrun's), each with its own ONNX Runtime sessions, the collectives run by
  torch.distributed (gloo on CPU), and rank 0 broadcasting each step's batch.
- serve/ and runtime/llm_engine.py: serving and rank faults (a dead or hung rank turns /health red; the server
  exits 3 within the collective timeout + 5 s); examples/deploy/kubernetes/lws.yaml for LeaderWorkerSet.
- checkpoint/sharding.py (`--moe-ep`), plugins/tensorrt_registration.py (the collectives registered, never run
  with TensorRT), bench/parallel.py.
"""
