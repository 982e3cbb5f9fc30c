"""What several families share: the unfused baselines and the ring's parts."""
