// Uploads a cast read from stdin to the recorders named on the command line with upstream's client
// (tailscale.com/sessionrecording.ConnectToRecorder), one line at a time, and reports the result.
package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"tailscale.com/sessionrecording"
)

func main() {
	var addrs []netip.AddrPort
	for _, a := range os.Args[1:] {
		addrs = append(addrs, netip.MustParseAddrPort(a))
	}
	var d net.Dialer
	w, attempts, errc, err := sessionrecording.ConnectToRecorder(context.Background(), addrs, d.DialContext)
	for _, at := range attempts {
		fmt.Printf("attempt %s %q\n", at.Recorder, at.FailureMessage)
	}
	if err != nil {
		fmt.Println("connect error:", err)
		os.Exit(2)
	}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if _, err := w.Write(append(sc.Bytes(), '\n')); err != nil {
			fmt.Println("write error:", err)
			os.Exit(3)
		}
		time.Sleep(10 * time.Millisecond)
	}
	w.Close()
	select {
	case err := <-errc:
		if err != nil {
			fmt.Println("upload error:", err)
			os.Exit(4)
		}
	case <-time.After(30 * time.Second):
		fmt.Println("no result")
		os.Exit(5)
	}
	fmt.Println("uploaded")
}
