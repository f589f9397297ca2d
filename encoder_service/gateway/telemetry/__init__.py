"""What the gateway tells its operator.

- `metrics.py`: Prometheus metrics, every label set exported from the start.
- `tracing.py`: OpenTelemetry traces of chat requests (off unless configured), traceparent
  to every upstream; `otlp.py`: their OTLP/HTTP export (protobuf encoded here).
- `top.py`: `epd top`, a live view of a deployment from its gateway's /metrics and
  /instances.
- `log_lines.py`: the gateway's key=value log lines, written in batches.
"""
