"""KV pipes: a prefill-side sender and a decode-side receiver on codec + transport + side channel.

One transfer, keyed by the router's transfer id (never a vLLM request id), in batches of
transferThresholdTokens (docs/kv-connector.md has the whole exchange):

    sender                                   receiver (decode worker, side channel on kv_port + rank)
    offer {id, cache signature, blocks} ->   checks the signature; waits (up to hold) for decode to
                                             expect the id; names its KV blocks or reserves staging
                                     <-      accept {skip, count, block addresses}
    per batch: gather, encode, write,   ->   per batch: verify the checksum, decode, scatter
               announce {header}             (two-sided transports: announce first, then send)
    done                                ->
                                     <-      ack, or nack {reason}

Mid-stream, decode may nack at any time (the load was cancelled or a chunk failed): the sender
stops writing, waits for the write under way, and answers abort; only then does decode end the
part and report the load, so vLLM never frees blocks that are still written (H5). A connection
whose first message is `end {id}` (the router, when decode refused a request prefill already
sends: end.end_transfer) makes decode refuse that id's offers at once instead of holding them (M2).

Everything a peer sends is validated (messages.py) before use; every failure on either side ends
the transfer with a recorded, bounded reason, and decode tells a peer which fields differ, never
its own values (H6, L2, L3).

Where the TP sizes differ, a prefill rank opens one such transfer per decode rank it sends heads
to (layout.plan_tp_mapping), and decode's expectation ends when every sender's part did.
Codec none over a one-sided transport writes block to block with no staging copy; compressed KV
(and any two-sided transport) goes through the registered staging buffers. Every expectation ends
exactly once (loaded, failed, timed out or cancelled) and every staging reservation is released.

The modules, one idea each: common (config, stats, errors, what both sides share); for prefill,
sender (jobs, threads, outcomes), rank_send (one decode rank's exchange), chunk_encoder (chunks made
ready) and chunk_writer (chunks written); for decode, receiver (the side channel, a part's chunk
loop), offer_check (an offer against the expectation), part_channel (nacks: telling a sender to
stop), chunk_reader (a chunk taken in), expectations, layer_stream and staging_window; messages (the
side channel's typed messages), end (ending an id), tensor_api (the seed's
`KVPipe.send_kv_cache` / `receive_kv_cache` on the same machinery).
"""
