#!/bin/sh
# Joins deploy/compose.yaml's six Redis nodes into one cluster (three primaries, one replica
# each) unless they are one already, and waits until every slot is served and every replica
# is in sync. Runs in the Redis image (redis-cli, getent); idempotent.
set -eu
NODES="redis-1 redis-2 redis-3 redis-4 redis-5 redis-6"
for n in $NODES; do
    until redis-cli -h "$n" ping 2>/dev/null | grep -q PONG; do sleep 0.5; done
done
if ! redis-cli -h redis-1 cluster info | grep -q cluster_state:ok; then
    addresses=""
    for n in $NODES; do
        addresses="$addresses $(getent hosts "$n" | cut -d' ' -f1):6379"
    done
    redis-cli --cluster create $addresses --cluster-replicas 1 --cluster-yes
fi
in_sync() {  # every primary has a replica whose link is up
    for n in $NODES; do
        if redis-cli -h "$n" role | head -1 | grep -q master; then
            redis-cli -h "$n" info replication | grep -q 'slave0:.*state=online' || return 1
        fi
    done
}
until redis-cli -h redis-1 cluster info | grep -q cluster_state:ok && in_sync; do
    sleep 0.5
done
echo "redis cluster ok: $(redis-cli -h redis-1 cluster nodes | grep -c master) primaries, each with a replica in sync"
