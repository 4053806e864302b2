"""A prefill/decode proxy for vLLM servers that share kvcache: one OpenAI-compatible endpoint
in front of prefill instances and decode instances (``python -m kvcache.integrations.vllm.proxy``).

It follows vLLM's own disaggregation convention, so it serves kvcache's connector and any other
that speaks it: each client request goes first to a prefill instance with ``max_tokens=1``,
``stream=false`` and ``kv_transfer_params={"do_remote_decode": true}``; the
``kv_transfer_params`` of that answer go, with the client's own request, to a decode instance,
whose answer (streamed or not, as the client asked) is relayed. See docs/disaggregation.md.

Split in three: ``routing`` (the request rewrites and the balancer: plain Python, testable
anywhere), ``app`` (the aiohttp server and its upstream calls) and ``__main__`` (the command
line). Only ``app`` and ``__main__`` need aiohttp, which vLLM's environment has and kvcache's
own does not require; nothing else in kvcache imports this package.
"""
