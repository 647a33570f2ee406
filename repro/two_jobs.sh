#!/bin/bash
# Two jobs started on the same output_dir at once.
cd /work/hunt_i; D=/tmp/hunt_i_b; rm -rf $D
(./repro/run.sh $D steps=150 checkpoint.every_steps=10 > /tmp/hunt_i_b_A.log 2>&1; echo "A rc=$?" >> /tmp/hunt_i_b_A.log) &
sleep 9; ./repro/run.sh $D steps=150 checkpoint.every_steps=10 > /tmp/hunt_i_b_B.log 2>&1; echo "B rc=$?"; wait
grep -v "Loading\|Writing" /tmp/hunt_i_b_A.log | tail -3; echo ----; grep -v "Loading\|Writing" /tmp/hunt_i_b_B.log | tail -3
grep -c "Ready to accept" $D/redis/redis-server.log
