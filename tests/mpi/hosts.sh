#!/usr/bin/env bash
# Several hosts emulated on one machine (issue 72): each host a Linux network namespace with an
# address of its own on a private /24, joined by a bridge; Open MPI starts its daemons in them
# through an rsh agent of this script's (no ssh), so ranks on different emulated hosts talk TCP
# through the bridge, as ranks on different machines would (docs/distributed.md, "Several hosts").
#
#   hosts.sh check                      exit 0 when namespaces can be made here, else 77 with why
#   hosts.sh up N [PREFIX] [SLOTS]      N hosts PREFIX1..PREFIXN (PREFIX-1.. when PREFIX ends in a
#                                       digit; default PREFIX frh<pid>), SLOTS ranks each in the
#                                       hostfile (default 1); prints the PREFIX
#   hosts.sh mpirun PREFIX ARGS...      mpirun with the settings the emulated hosts need, then ARGS
#                                       (-H PREFIX1:2,PREFIX2:2 ..., or the hostfile when ARGS name
#                                       no hosts); prints the command line on stderr first
#   hosts.sh hosts PREFIX [R]           the host names as mpirun's -H list, R ranks each (default 1):
#                                       PREFIX1:R,PREFIX2:R,...
#   hosts.sh args PREFIX                those settings on one line: mpirun $(hosts.sh args PREFIX) ...
#   hosts.sh exec PREFIX HOST CMD...    CMD run as on HOST (its network, its host name)
#   hosts.sh down PREFIX                removes what up made: namespaces, links, state folder
#
# FLOWRUN_HOSTS_PRIVATE="HOST:DIR ..." (in the environment of mpirun or exec; read at each start by
# the agent): HOST's processes run in a mount namespace of their own with an empty tmpfs mounted
# on DIR (absolute, existing, no spaces), so that host does not see what the others see there (a
# folder on a host's local disk, not the shared file system). The mount lives only in those
# processes' namespace: it goes when they end (nothing for down to undo).
#
# Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; what it makes: namespaces
# PREFIX1..N, a bridge frbrX with address 10.231.X.254, veth pairs frXvI <-> eth0 (10.231.X.I in
# host I), and /tmp/flowrun-hosts-PREFIX/ (hostfile, agent, subnet, names, hosts: each one's
# address). X is picked from PREFIX's hash, skipping a /24 in use here. Tests call `down` in a trap.
set -u
state_root=/tmp

die() { echo "hosts.sh: $*" >&2; exit 1; }
state_of() { echo "$state_root/flowrun-hosts-$1"; }
host_name() { case $1 in *[0-9]) echo "$1-$2" ;; *) echo "$1$2" ;; esac; }
load() {  # load PREFIX: the state up wrote, or an error
  st=$(state_of "$1")
  [ -f "$st/subnet" ] || die "no emulated hosts '$1' ($st/subnet missing: run 'hosts.sh up N $1' first)"
  read -r x < "$st/subnet"
  mapfile -t names < "$st/names"
}

check() {
  local why=""
  if [ "$(id -u)" != 0 ]; then why="not root (network namespaces need root)"
  elif ! command -v ip > /dev/null; then why="no 'ip' command (apt-get install iproute2)"
  elif ! command -v unshare > /dev/null; then why="no 'unshare' command (util-linux)"
  elif ! command -v mpirun > /dev/null; then why="no mpirun (apt-get install openmpi-bin)"
  else
    local t=frhchk$$ err
    if ! err=$(ip netns add $t 2>&1); then why="'ip netns add' refused: $err"
    elif ! err=$(ip link add frck$$a type veth peer name frck$$b 2>&1); then why="'ip link add type veth' refused: $err"
    elif ! err=$(ip link set frck$$b netns $t 2>&1); then why="moving a veth into a namespace refused: $err"
    elif ! err=$(ip netns exec $t unshare --uts sh -c 'hostname frhchk' 2>&1); then why="a UTS namespace refused: $err"
    fi
    ip link del frck$$a 2> /dev/null
    ip netns del $t 2> /dev/null
  fi
  if [ -n "$why" ]; then
    echo "SKIP: cannot emulate hosts with network namespaces here: $why"
    exit 77
  fi
}

up() {
  local n=$1 prefix=${2:-frh$$} slots=${3:-1}
  [[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 64 ] || die "up: N must be 1 to 64, not '$n'"
  [[ $prefix =~ ^[a-z][a-z0-9]{0,19}$ ]] || die "up: PREFIX must be a lower-case letter then up to 19 letters or digits, not '$prefix'"
  [[ $slots =~ ^[0-9]+$ ]] || die "up: SLOTS must be a number, not '$slots'"
  local st; st=$(state_of "$prefix")
  mkdir "$st" 2> /dev/null || die "up: cannot make $st (it exists: 'hosts.sh down $prefix' first)"
  : > "$st/names"
  # From here on, a failure undoes what was made (PREFIX, checked above, expanded now).
  # shellcheck disable=SC2064
  trap "echo 'hosts.sh: up failed; removing what it made' >&2; down $prefix > /dev/null 2>&1" EXIT
  # X from PREFIX's hash (so parallel runs with other prefixes take other subnets), moved on while
  # the /24 is routed here already or another run's bridge holds it. Adding the bridge frbrX is
  # the claim on X (the kernel refuses a second link of that name), so two ups never share one.
  local h x i tries br err
  h=$(printf %s "$prefix" | cksum | cut -d' ' -f1)
  x=$(( h % 200 + 20 ))
  for tries in $(seq 201); do
    [ "$tries" = 201 ] && die "up: no free 10.231.X.0/24 left (X 20 to 219)"
    if ip -4 route show | grep -q "^10\.231\.$x\." || ip -4 addr show | grep -q " 10\.231\.$x\."; then
      :  # the subnet is in use here
    elif err=$(ip link add "frbr$x" type bridge 2>&1); then
      break
    elif ! ip link show "frbr$x" > /dev/null 2>&1; then
      die "up: cannot add bridge frbr$x: $err"
    fi
    x=$(( (x - 20 + 1) % 200 + 20 ))
  done
  echo "$x" > "$st/subnet"
  br=frbr$x
  ip addr add "10.231.$x.254/24" dev "$br" || die "up: cannot address $br"
  ip link set "$br" up || die "up: cannot bring $br up"
  local hosts=() ns
  for i in $(seq "$n"); do
    ns=$(host_name "$prefix" "$i")
    ip netns list | grep -q "^$ns\b" && die "up: namespace $ns exists already"
    ip netns add "$ns" || die "up: cannot add namespace $ns"
    echo "$ns" >> "$st/names"
    ip link add "fr${x}v$i" type veth peer name "fr${x}p$i" || die "up: cannot add veth fr${x}v$i"
    ip link set "fr${x}v$i" master "$br" up || die "up: cannot attach fr${x}v$i to $br"
    ip link set "fr${x}p$i" netns "$ns" || die "up: cannot move fr${x}p$i into $ns"
    ip -n "$ns" link set "fr${x}p$i" name eth0 || die "up: cannot rename the veth in $ns"
    ip -n "$ns" addr add "10.231.$x.$i/24" dev eth0 || die "up: cannot address eth0 in $ns"
    ip -n "$ns" link set eth0 up || die "up: cannot bring eth0 up in $ns"
    ip -n "$ns" link set lo up || die "up: cannot bring lo up in $ns"
    echo "$ns slots=$slots" >> "$st/hostfile"
    echo "10.231.$x.$i $ns" >> "$st/hosts"
    hosts+=("$ns")
  done
  # The rsh agent Open MPI calls as `agent HOST CMD...` (plm_rsh_agent): CMD run by sh, as a remote
  # shell would, in HOST's namespace under a UTS namespace of its own named HOST, so the daemon and
  # its ranks see gethostname() == HOST and their own network only. The environment is the
  # caller's (unlike ssh; the ranks get mpirun's -x variables either way). FLOWRUN_HOSTS_PRIVATE
  # (the top) adds a mount namespace and the tmpfs mounts, made before CMD starts.
  cat > "$st/agent" <<AGENT
#!/bin/sh
# rsh agent for emulated hosts $prefix (made by tests/mpi/hosts.sh up; removed by its down).
host=\${1#*@}; shift
case " ${hosts[*]} " in
  *" \$host "*) ;;
  *) echo "hosts.sh agent: '\$host' is none of the emulated hosts: ${hosts[*]}" >&2; exit 255 ;;
esac
private=""
for e in \${FLOWRUN_HOSTS_PRIVATE:-}; do
  case \$e in
    "\$host":/*) private="\$private \${e#*:}" ;;
    *:/*) ;;
    *) echo "hosts.sh agent: FLOWRUN_HOSTS_PRIVATE: '\$e' is not HOST:/ABSOLUTE/DIR" >&2; exit 255 ;;
  esac
done
if [ -z "\$private" ]; then
  exec ip netns exec "\$host" unshare --uts sh -c 'hostname "\$0" && exec sh -c "\$1"' "\$host" "\$*"
fi
exec ip netns exec "\$host" unshare --uts --mount --propagation private sh -c '
  hostname "\$0" || exit 255
  for d in \$2; do
    mount -t tmpfs -o size=64m tmpfs "\$d" || { echo "hosts.sh agent: cannot mount a private tmpfs on \$d on \$0" >&2; exit 255; }
  done
  exec sh -c "\$1"' "\$host" "\$*" "\$private"
AGENT
  chmod +x "$st/agent"
  trap - EXIT
  echo "$prefix"
}

# The mpirun settings: the agent (no tree spawn: mpirun starts every daemon itself), TCP between
# hosts on the emulated subnet only (vader, shared memory, between the ranks of one host, as on
# real hosts), no hwloc rtc (Open MPI 4.1's orted was seen to crash in hwloc_shmem_topology_write
# in 10-20 % of launches into namespaces; without the rtc framework's hwloc component 30 of 30
# started. With a host name per host, as here, 30 of 30 started without it too: kept, harmless).
args() {
  load "$1"
  # shellcheck disable=SC2054  # tcp,vader,self: one value
  local a=(--mca plm_rsh_agent "$st/agent" --mca plm_rsh_no_tree_spawn 1
           --mca btl tcp,vader,self --mca btl_vader_single_copy_mechanism none
           --mca btl_tcp_if_include "10.231.$x.0/24" --mca oob_tcp_if_include "10.231.$x.0/24"
           --mca rtc ^hwloc --oversubscribe --bind-to none)
  [ "$(id -u)" = 0 ] && a+=(--allow-run-as-root)
  echo "${a[*]}"
}

run_mpirun() {
  local prefix=$1; shift
  local a; read -r -a a < <(args "$prefix")
  [ ${#a[@]} -gt 0 ] || exit 1
  load "$prefix"
  local named=0 arg
  for arg in "$@"; do
    case $arg in -H|--host|-host|--hostfile|-hostfile|--machinefile|-machinefile|--default-hostfile) named=1 ;; esac
  done
  [ $named = 1 ] || a+=(--hostfile "$st/hostfile")
  echo "+ mpirun ${a[*]} $*" >&2
  exec mpirun "${a[@]}" "$@"
}

hosts_list() {
  load "$1"
  local r=${2:-1} out="" ns
  for ns in "${names[@]}"; do out+="${out:+,}$ns:$r"; done
  echo "$out"
}

run_exec() {
  load "$1"
  local host=$2; shift 2
  exec "$st/agent" "$host" "$(printf '%q ' "$@")"
}

down() {
  local prefix=$1 st x ns i pid
  st=$(state_of "$prefix")
  [ -d "$st" ] || { echo "hosts.sh: nothing to remove for '$prefix' ($st missing)" >&2; return 0; }
  x=$(cat "$st/subnet" 2> /dev/null)
  i=0
  while read -r ns; do
    i=$((i + 1))
    [ -n "$ns" ] || continue
    # Processes still in the namespace (a daemon of a job that failed): ended, then the namespace.
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -TERM "$pid" 2> /dev/null; done
    for _ in 1 2 3 4 5 6 7 8 9 10; do [ -z "$(ip netns pids "$ns" 2> /dev/null)" ] && break; sleep 0.2; done
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -KILL "$pid" 2> /dev/null; done
    [ -n "$x" ] && ip link del "fr${x}v$i" 2> /dev/null
    ip netns del "$ns" 2> /dev/null
    # Open MPI's session folder of that host name, if a killed daemon left it.
    rm -rf "/tmp/ompi.$ns.$(id -u)"
  done < "$st/names"
  [ -n "$x" ] && ip link del "frbr$x" 2> /dev/null
  rm -rf "$st"
  return 0
}

usage() { sed -n '2,/^set -u$/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
cmd=$1; shift
case $cmd in
  check) check ;;
  up) [ $# -ge 1 ] || usage; check >&2; up "$@" ;;
  hosts) [ $# -ge 1 ] && [ $# -le 2 ] || usage; hosts_list "$@" ;;
  args) [ $# = 1 ] || usage; args "$1" ;;
  mpirun) [ $# -ge 1 ] || usage; run_mpirun "$@" ;;
  exec) [ $# -ge 3 ] || usage; run_exec "$@" ;;
  down) [ $# = 1 ] || usage; down "$1" ;;
  *) usage ;;
esac
