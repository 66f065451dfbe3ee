"""The runtime: the lanes (a compute lane, load lanes) and the loop that drives a policy over them."""
