//go:build tools

// Package tools names the commands this module builds, so that `go mod tidy` keeps their
// dependencies: `go build` of each is run by infra/stack/k8s.py.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
