"""Many devices: meshes and the logical-axis rules table (`sharding`), the memory/FLOPs planner
(`plan`), and JAX's multi-process runtime (`distributed`)."""
