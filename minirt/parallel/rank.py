"""A tensor-parallel rank's entry point, `python -m minirt.parallel.rank HOST PORT RANK WORLD_SIZE`, started by
`minirt.parallel.workers.RankProcess`: a clean interpreter that runs this module, never the parent's main module;
everything else it needs (the `RankSpec`) it reads from rank 0's TCP store at HOST:PORT."""

import sys

from minirt.parallel.workers import rank_main

if __name__ == "__main__":
    host, port, rank, world_size = sys.argv[1:]
    rank_main(host, int(port), int(rank), int(world_size))
