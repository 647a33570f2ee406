#!/bin/bash
# output_dir on a 50 MiB tmpfs: the third checkpoint (21 MiB each) fills it. Then resume=auto after freeing space.
cd /work/hunt_i; M=/tmp/hunt_i_tmpfs; mkdir -p $M; umount $M 2>/dev/null; mount -t tmpfs -o size=50m tmpfs $M
./repro/run.sh $M/run steps=8 > /tmp/hunt_i_full.log 2>&1; echo "rc=$?"
grep -v "Loading\|Writing" /tmp/hunt_i_full.log | grep -v "^  \|^$\|^Traceback\|^During" | tail -6
grep -c "keep-alive" /tmp/hunt_i_full.log
