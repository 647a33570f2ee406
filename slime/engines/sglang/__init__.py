"""SGLang behind the engine contract, and the SGLang protocol in front of our own engine.

adapter.py holds `SglangEngine` (the contract over SGLang servers, launched or attached, over
HTTP); processes.py launches and watches those servers; launch.py is the entry point of those
processes (``python -m slime.engines.sglang.launch``). protocol.py, server.py and engine_thread.py
serve the built-in engine under SGLang's HTTP API (`slime serve-sglang`), so tools written for
SGLang can drive it.

Nothing is imported here: ``python -m slime.engines.sglang.launch router`` runs this file and
must not load torch."""
