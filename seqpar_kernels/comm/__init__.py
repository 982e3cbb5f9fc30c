"""Process-group plumbing above the ops: exchange plans (plan), the all-to-all of ranges
(exchange), the P2P ring (ring), and a group, two groups or a mesh resolved (grid)."""
