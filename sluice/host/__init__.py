"""Facts about the machine this process runs on: the memory room (MemAvailable, memory cgroups), usable CPUs
(affinity, CPU quota), cgroup files, and the kernel's per-process counters (/proc)."""
