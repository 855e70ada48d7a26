#!/usr/bin/env bash
# Drain this Ray node before it goes away: Ray places nothing new on it, the run's generator pool takes its engines
# out (they finish what they hold, then leave) and asks for their places on other nodes (docs/elastic.md). Once
# idle, the drained raylet exits on its own. Two uses:
#   drain_node.sh now SECONDS    announce it at once (a pre-stop hook, a scale-in), then wait up to SECONDS for the
#                                raylet to exit
#   drain_node.sh watch-ec2      on an EC2 spot instance, poll for the interruption notice (two minutes ahead) and
#                                then drain with a 100 s deadline; on an on-demand instance, exit at once
# `ray drain-node` finds the node's cluster from its running raylet and authenticates with the node's own
# RAY_AUTH_* settings.
set -u

imds() {  # an EC2 instance metadata path (IMDSv2), empty when absent
  local token
  token=$(curl -s -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" http://169.254.169.254/latest/api/token)
  curl -sf -H "X-aws-ec2-metadata-token: $token" "http://169.254.169.254/latest/meta-data/$1"
}

case "${1:-}" in
  now) seconds="${2:-60}"; why="node stopping (pre-stop hook)" ;;
  watch-ec2)
    [ "$(imds instance-life-cycle)" = spot ] || exit 0
    until imds spot/instance-action > /dev/null; do sleep 5; done
    seconds=100; why="EC2 spot interruption notice" ;;
  *) echo "usage: drain_node.sh now SECONDS | watch-ec2" >&2; exit 2 ;;
esac

ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "$why" --deadline-remaining-seconds "$seconds"
for _ in $(seq "$seconds"); do  # the drained raylet exits once its node is idle
  pgrep -x raylet > /dev/null || exit 0
  sleep 1
done
