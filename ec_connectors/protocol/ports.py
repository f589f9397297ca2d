"""The port scheme of an EPD deployment, in one place (torch-free): the gateway's default port,
the Mooncake Transfer Engine side channels (purposes, ranks, the per-encoder stride `epd up`
uses) and the Mooncake Store master's ports. Every default elsewhere (`epd up`, `epd gateway`,
`epd master`, EPDConfig, compose, k8s) follows this module."""

from __future__ import annotations

from ec_connectors.protocol.net import parse_endpoint

# --- the gateway (`epd gateway`, `epd up`, `epd demo`) ---
GATEWAY_PORT = 18100  # `epd up`: its vLLM servers take the next ports

# --- Mooncake Transfer Engine side channels ---
MOONCAKE_BASE_PORT = 15500  # EPDConfig.base_port's default; `epd up` mooncake_base_port
MOONCAKE_ENCODER_STRIDE = 10  # `epd up`: encoder i uses base + 10 * i (its ranks stay below)
PURPOSE_SERVE = 0  # side channel: pull requests and replies (ZMQ ROUTER on the producer)
PURPOSE_ANNOUNCE = 1000  # announcements of stored items (ZMQ PUB on the producer)
PURPOSE_STREAM = 2000  # data connections of the socket data path (TCP listener on the producer)
MAX_RANKS_PER_NODE = 1000  # stage_offset + dp_rank * world + rank must stay below this

# --- the Mooncake Store master (`epd master`, `epd up` with mooncake_store or tiered) ---
MASTER_RPC_PORT = 50051  # `store_master`; its HTTP metadata server on +1, metrics on +2
MASTER_HTTP_OFFSET = 1
MASTER_METRICS_OFFSET = 2


def port_for(base_port: int, purpose: int, stage_offset: int, dp_rank: int, world_size: int,
             rank: int) -> int:
    """`base + purpose_offset + stage_offset + dp_index * tp_size + tp_rank` (world_size =
    workers of one engine, tp * pp), so DP replicas and TP ranks on one node never collide."""
    local = stage_offset + dp_rank * world_size + rank
    if local >= MAX_RANKS_PER_NODE:
        raise ValueError(f"stage_offset + dp_rank * world + rank = {local} exceeds "
                         f"{MAX_RANKS_PER_NODE - 1}: ports of two purposes would collide")
    port = base_port + purpose + local
    if port > 65535:
        raise ValueError(f"port {port} is out of range; lower base_port")
    return port


def announce_port(serve_port: int) -> int:
    """A producer's announcement port from its side-channel port."""
    return serve_port + PURPOSE_ANNOUNCE - PURPOSE_SERVE


def announce_endpoint(serve_endpoint: str) -> str:
    """A producer's announcement address from its side-channel address."""
    host, port = parse_endpoint(serve_endpoint)
    return f"{host}:{announce_port(port)}"


def stream_port(serve_port: int) -> int:
    """A producer's stream port (`te_data_path` socket) from its side-channel port."""
    return serve_port + PURPOSE_STREAM - PURPOSE_SERVE


def encoder_base_port(mooncake_base_port: int, index: int) -> int:
    """`epd up`: the side-channel base port of encoder `index` (its rank 0 serves there)."""
    return mooncake_base_port + MOONCAKE_ENCODER_STRIDE * index


def master_http_port(rpc_port: int) -> int:
    """The store master's HTTP metadata server (`store_metadata`) beside RPC `rpc_port`."""
    return rpc_port + MASTER_HTTP_OFFSET


def master_metrics_port(rpc_port: int) -> int:
    """The store master's Prometheus metrics beside RPC `rpc_port`."""
    return rpc_port + MASTER_METRICS_OFFSET


def store_metadata_url(store_master: str) -> str:
    """`store_metadata` of a master at `store_master` (`host:port`, its RPC address)."""
    host, port = parse_endpoint(store_master)
    return f"http://{host}:{master_http_port(port)}/metadata"
