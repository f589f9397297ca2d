"""The port plan of an EPD deployment, in one place.

The port plan of an EPD deployment, in one place (torch-free): the gateway's default port,
the Mooncake Transfer Engine side channels (purposes, ranks, the per-encoder stride `epd up`
uses), the Mooncake Store master's ports, and the range the Mooncake engines' own listeners
take their random ports from (`engine_ports`: clear of every fixed port). Every default
elsewhere (`epd up`, `epd gateway`, `epd master`, EPDConfig, compose, k8s) follows this
module."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from epd_common.net import parse_endpoint

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

# --- the Mooncake engines' own listeners (a Transfer Engine, a Store client's engine) ---
# Each engine binds two ports (handshake, TCP data) picked at random in [MC_MIN_RPC_PORT,
# MC_MAX_RPC_PORT], read once when the process imports mooncake; Mooncake's default
# 15000-17000 holds the side channels above, so whichever process bound first took the other's
# port. The plan: ENGINE_PORTS unless a fixed port falls inside, else the first ENGINE_SPAN
# ports clear of them between ENGINE_FLOOR and the kernel's ephemeral ports (vLLM's own).
ENGINE_MIN_ENV, ENGINE_MAX_ENV = "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"
ENGINE_PORTS = (25000, 25999)
ENGINE_SPAN = ENGINE_PORTS[1] - ENGINE_PORTS[0] + 1
ENGINE_FLOOR, ENGINE_CEILING = 10000, 32767
UP_MAX_SERVERS = 32  # `epd up`: at most 16 encoders + 16 decoders after its gateway port


def port_for(base_port: int, purpose: int, stage_offset: int, dp_rank: int, world_size: int,
             rank: int) -> int:
    """The port of one rank for one purpose, unique across DP replicas and TP ranks.

    `base + purpose_offset + stage_offset + dp_index * tp_size + tp_rank` (world_size =
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


def purpose_block(base_port: int, ranks: int = MOONCAKE_ENCODER_STRIDE) -> list[int]:
    """The ports a producer's first ranks serve on from a base port.

    The ports of a producer's first `ranks` ranks serving from `base_port` (side channel,
    announcements, data connections each): what `epd up` leaves each encoder."""
    return [port + local for port in producer_ports(base_port) for local in range(ranks)]


def producer_ports(serve_port: int) -> list[int]:
    """A producer's side channel, announcements and data connections."""
    return [serve_port, announce_port(serve_port), stream_port(serve_port)]


def master_ports(rpc_port: int) -> list[int]:
    """The store master's RPC, HTTP metadata and metrics ports."""
    return [rpc_port, master_http_port(rpc_port), master_metrics_port(rpc_port)]


def up_fixed_ports(base_port: int, servers: int, mooncake_base_port: int | None,
                   encoders: int, master_port: int | None) -> dict[int, str]:
    """Map every fixed port of an `epd up` deployment to what holds it.

    Every fixed port of an `epd up` deployment -> what holds it: the gateway, `servers`
    vLLM servers / encoder pools after it, each encoder's side-channel ports (a stride of
    ranks per purpose) and the store master's three."""
    fixed = {base_port: "the gateway"}
    fixed.update({base_port + 1 + i: f"server {i}" for i in range(servers)})
    if mooncake_base_port is not None:
        for i in range(encoders):
            fixed.update(dict.fromkeys(purpose_block(encoder_base_port(mooncake_base_port, i)),
                                       f"encoder {i}'s side channel"))
    if master_port is not None:
        fixed.update({p: "the store master" for p in master_ports(master_port)})
    return fixed


def engine_ports(fixed: Iterable[int]) -> tuple[int, int]:
    """Choose the Mooncake engines' port range clear of every fixed port.

    The engine port range (first, last) that holds none of the `fixed` ports nor a
    default deployment's (DEFAULT_FIXED: a producer started by hand with the defaults may
    share the host): ENGINE_PORTS when it is clear, else the lowest ENGINE_SPAN ports clear
    of them in [ENGINE_FLOOR, ENGINE_CEILING]. ValueError when no such range exists."""
    taken = sorted({p for p in (*fixed, *DEFAULT_FIXED) if ENGINE_FLOOR <= p <= ENGINE_CEILING})
    if not _inside(taken, *ENGINE_PORTS):
        return ENGINE_PORTS
    low = ENGINE_FLOOR
    for port in [*taken, ENGINE_CEILING + 1]:
        if port - low >= ENGINE_SPAN:
            return low, low + ENGINE_SPAN - 1
        low = max(low, port + 1)
    raise ValueError(f"no {ENGINE_SPAN} ports in {ENGINE_FLOOR}-{ENGINE_CEILING} are clear "
                     "of the deployment's fixed ports; move some of them")


def _inside(ports: Iterable[int], first: int, last: int) -> list[int]:
    return [p for p in ports if first <= p <= last]


def engine_env(fixed: Mapping[int, str] | Iterable[int],
               environ: Mapping[str, str]) -> dict[str, str]:
    """The Mooncake engine port range variables for a process, checked.

    MC_MIN_RPC_PORT / MC_MAX_RPC_PORT for a process whose host holds the `fixed` ports
    (a mapping names what holds each): the range `environ` sets, checked, else the plan's
    (`engine_ports`). Raises ValueError naming the colliding ports when the set range holds
    a fixed port, and when it is not a valid range (Mooncake would fall back to 15000-17000
    silently)."""
    names = dict(fixed) if isinstance(fixed, Mapping) else dict.fromkeys(fixed, "")
    first_s, last_s = environ.get(ENGINE_MIN_ENV), environ.get(ENGINE_MAX_ENV)
    if first_s is None and last_s is None:
        first, last = engine_ports(names)
        return {ENGINE_MIN_ENV: str(first), ENGINE_MAX_ENV: str(last)}
    try:
        first, last = int(first_s or ""), int(last_s or "")
    except ValueError:
        raise ValueError(f"{ENGINE_MIN_ENV}={first_s} / {ENGINE_MAX_ENV}={last_s}: set both, "
                         "as port numbers (or neither: the port plan picks them)") from None
    if not 1024 <= first < last <= 65535:
        raise ValueError(f"{ENGINE_MIN_ENV}={first} / {ENGINE_MAX_ENV}={last} is not a range "
                         "of at least two ports in 1024-65535 (each engine binds two)")
    hit = _inside(sorted(names), first, last)
    if hit:
        runs: list[list[int]] = []  # consecutive ports held by the same thing
        for p in hit:
            if runs and p == runs[-1][-1] + 1 and names[p] == names[runs[-1][0]]:
                runs[-1].append(p)
            else:
                runs.append([p])
        shown = ", ".join(("-".join(map(str, sorted({r[0], r[-1]})))
                           + (f" ({names[r[0]]})" if names[r[0]] else "")) for r in runs[:8])
        more = f" and {len(runs) - 8} more" if len(runs) > 8 else ""
        raise ValueError(
            f"{ENGINE_MIN_ENV}/{ENGINE_MAX_ENV} = {first}-{last} holds fixed ports of this "
            f"deployment: {shown}{more}; a Mooncake engine could take them first. Unset both "
            f"(the port plan picks {'-'.join(map(str, engine_ports(names)))}) or choose a "
            "range clear of them")
    return {ENGINE_MIN_ENV: str(first), ENGINE_MAX_ENV: str(last)}


# the fixed ports of a default deployment (`epd up` at its largest, a producer's default side
# channels, the master's): every planned engine range stays clear of them too
DEFAULT_FIXED = frozenset(up_fixed_ports(GATEWAY_PORT, UP_MAX_SERVERS, MOONCAKE_BASE_PORT,
                                         UP_MAX_SERVERS // 2, MASTER_RPC_PORT))
