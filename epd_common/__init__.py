"""General helpers with no EPD knowledge, shared by every package of the project.

- `child_process.py`: child processes that die with their parent (process groups, a
  parent-death signal), started and stopped with deadlines.
- `config_files.py`: reading JSON/TOML config files and the one error format of every
  validated config.
- `lru.py`: `BoundedLRU`, a dict bounded by entry count.
- `net.py`: hosts and `host:port` endpoints: parsing, validation, who listens on a port.
"""
